"""Settings for every test run from the repository root (tests/, contrib/, plugins/)."""

import torch

# The test models are tiny: one thread is far faster than two OpenMP workers waiting on each
# other on a busy 2-core machine (a 7-step run took 10x longer). Subprocess tests keep torch's
# default.
torch.set_num_threads(1)
