"""Performance maths and tools, independent of Lightning: device peaks, FLOP and byte
counting, attention FLOPs of packed documents, the measured window of steps, throughput/MFU
under any parallel layout, roofline, overlap of communication, host-device sync detection,
dataloader stalls, memory by category, advice that knows the run's settings, and the end-of-run
summary."""

from lightning_perf.perf.advice import Advice, advise
from lightning_perf.perf.comm import (
    BUS_FACTORS,
    LINKS,
    CommAnalysis,
    StepBreakdown,
    analyze_comm_trace,
    bus_bandwidth,
    expected_link,
    step_breakdown,
)
from lightning_perf.perf.dataloader import dataloader_advice, exposed_wait
from lightning_perf.perf.documents import (
    AttentionFlops,
    DocumentWork,
    DocumentWorkReader,
    document_attention_flops,
    document_lengths,
    document_work,
    packed_batch_flops,
)
from lightning_perf.perf.flops import CATEGORIES, FlopCount, OpCounter, OpRecord, count_flops, op_category
from lightning_perf.perf.gpu_time import GPU_TIME_RULES, gpu_time_breakdown, gpu_time_category, kernel_label
from lightning_perf.perf.intervals import OverlapStats, intersect, overlap_stats, total, union
from lightning_perf.perf.memory import MemoryReport, count_categories, memory_advice
from lightning_perf.perf.memory_snapshot import top_sites
from lightning_perf.perf.peaks import DTYPES, PEAKS, DevicePeak, compute_dtype_name, device_peak, lookup_peak
from lightning_perf.perf.report import PerfSummary, breakdown, recommendations, render_markdown
from lightning_perf.perf.roofline import RooflineGroup, build_groups, classify, plot_roofline, profiler_op_times
from lightning_perf.perf.run_settings import PerfSettings, RunSettings
from lightning_perf.perf.saved_activations import SavedTensorCounter
from lightning_perf.perf.sync import (
    SYNC_KINDS,
    CudaSyncCatcher,
    DispatchSyncDetector,
    SyncCallCatcher,
    SyncPointError,
    SyncRecorder,
    SyncSite,
    SyncWatch,
    classify_op,
    detector_plan,
)
from lightning_perf.perf.steps import EventPool, StepLedger, StepRecord, StepRow, StepTimer, StepWindow, host_clock
from lightning_perf.perf.throughput import (
    ParallelLayout,
    Throughput,
    compute_throughput,
    device_unit,
    measure_matmul_ceiling,
    over_reference,
    window_throughput,
)

__all__ = [
    "Advice", "advise",
    "BUS_FACTORS", "LINKS", "CommAnalysis", "StepBreakdown", "analyze_comm_trace", "bus_bandwidth", "expected_link",
    "step_breakdown",
    "dataloader_advice", "exposed_wait",
    "AttentionFlops", "DocumentWork", "DocumentWorkReader", "document_attention_flops", "document_lengths",
    "document_work", "packed_batch_flops",
    "CATEGORIES", "FlopCount", "OpCounter", "OpRecord", "count_flops", "op_category",
    "GPU_TIME_RULES", "gpu_time_breakdown", "gpu_time_category", "kernel_label",
    "OverlapStats", "intersect", "overlap_stats", "total", "union",
    "MemoryReport", "count_categories", "memory_advice", "top_sites",
    "DTYPES", "PEAKS", "DevicePeak", "compute_dtype_name", "device_peak", "lookup_peak",
    "PerfSummary", "breakdown", "recommendations", "render_markdown",
    "RooflineGroup", "build_groups", "classify", "plot_roofline", "profiler_op_times",
    "PerfSettings", "RunSettings", "SavedTensorCounter",
    "SYNC_KINDS", "CudaSyncCatcher", "DispatchSyncDetector", "SyncCallCatcher", "SyncPointError", "SyncRecorder",
    "SyncSite", "SyncWatch", "classify_op", "detector_plan",
    "EventPool", "StepLedger", "StepRecord", "StepRow", "StepTimer", "StepWindow", "host_clock",
    "ParallelLayout", "Throughput", "compute_throughput", "device_unit", "measure_matmul_ceiling", "over_reference",
    "window_throughput",
]
