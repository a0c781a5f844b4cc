"""Seeing a run: what it logs, what each rank did, and why a job is slow or stuck.

``logging.py`` (the rank-aware logger, Megatron's log line, TensorBoard, reductions of loss, bubble
and timeline), ``flight_recorder.py`` (one per-rank ring of actions, transfers, collectives and
phases; held by the ParallelState), ``hang_watch.py`` + ``diagnosis.py`` (the watch thread, the store
side channel and the diagnosis read from the rings), ``stragglers.py`` (per-rank own and wait time gathered
at each log line), ``profiling.py`` (torch.profiler, CUDA memory snapshots, wandb), ``throughput.py``
(FLOPs from the model spec, MFU, GPU memory), ``stop_line.py`` (why a job stopped, said once for the
whole job, whichever rank gets there first). Nothing here changes what a step computes.
"""
