"""Worker: two all_reduce calls on a process group, with NCCLTREE_DEBUG set by the test."""

import numpy as np

import nccltree as nt

pg = nt.init_process_group(algorithm="direct")
x = np.ones(1000, np.float32)
pg.all_reduce(x)
pg.all_reduce(x)
pg.close()
