"""Test-wide settings."""

import torch

# Tests run tiny models: one thread avoids OpenMP spin contention on small CPU machines, which
# makes tiny element-wise ops orders of magnitude slower when another process uses the other core.
torch.set_num_threads(1)
