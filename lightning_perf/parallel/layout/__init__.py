"""The parallel layout and its checks, with numbers alone, before any process group exists.

``dims``: the device mesh (pp, dp, cp, tp) and its sizes; ``config_3d``: the 3D options and the
model protocol check; ``zero_config``: the ZeRO options and the engine per stage; ``validate``:
the data shape against the model and the layout.
"""
