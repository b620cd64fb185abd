"""Diagnosing failed runs: dead or hung ranks, the NCCL flight recorder, non-finite losses and gradients.

``watchdog`` (heartbeats in the process group's store), ``flight_recorder`` (each rank's last
collectives) and ``numerics`` (non-finite flags read without a device sync).
"""
