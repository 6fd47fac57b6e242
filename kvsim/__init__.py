"""kvsim: a discrete-event simulator of vLLM KV-cache offload (GPU, DRAM, disk, page cache).

``python -m kvsim trace replay [TRACE]`` compares offload tiers on a request trace;
``python -m kvsim calibrate BENCH.json`` fits its IO profile to kvoffload's bench.
See docs/kvsim.md.
"""
