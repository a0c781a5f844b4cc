"""The rank grid and its process groups.

``grid.py`` (RankGrid: named axes as data, rank <-> coordinates, the ranks of the group along any set
of axes; no torch.distributed), ``state.py`` (ParallelState: the dense tp-cp-dp-pp grid and the
experts' etp-ep-edp grid, every process group created up front; the only module that creates groups
or asks the world for rank and size), ``agreement.py`` (does any rank report a problem, and which
one speaks for the job: one all-reduce).
"""
