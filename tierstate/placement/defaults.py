"""Default sizes of the offload policy (no torch import: the planner reads them too)."""

# 4 Mi elements per sub-group: a record of 16 MiB fp32 master + 32 MiB fp32 moments. Large
# enough that each record streams at full disk speed (requests of >= 8 MiB), small enough
# that each NVMe pool buffer holds 32-48 MiB of host RAM and that a 124M-parameter model
# gives ~30 sub-groups to overlap I/O with updates (16 Mi gave 8: measured 1.29x the
# floor vs 1.24x at 4 Mi in tierstate.bench.nvme_step on a loaded machine).
DEFAULT_SUBGROUP_NUMEL = 1 << 22

# 16 buffers: with 4 Mi-element sub-groups a pool of 512 MiB (fp32 params: m and v) to
# 768 MiB (low-precision params: + fp32 master). The pool is a write-back cache whose last
# buffer_count records of a step serve the next one, so each step moves S - buffer_count
# records each way: on GPT-2 124M (30 records) 4 buffers left 0.95 s of a 2.8 s step waiting
# on the disk, 16 buffers 0.29 s (tierstate bench e2e, loaded machine), at 0.5 GiB more RSS.
DEFAULT_BUFFER_COUNT = 16
