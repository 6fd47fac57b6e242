"""kvsim: a discrete-event simulator of vLLM KV-cache offload (GPU, DRAM, disk, page cache).

``python -m kvsim trace replay [TRACE]`` compares offload tiers on a request trace;
see docs/kvsim.md. ``kvsim.sim_device.SimDevice`` reuses the same idea of simulated
completion as a test device for kvoffload's backends.
"""
