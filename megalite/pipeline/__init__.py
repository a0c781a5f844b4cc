"""Pipeline parallelism at run time: schedules as data and the executor that runs them.

actions.py (the action types), schedules.py and zero_bubble.py (builders),
registry.py (every schedule described once: builder, layout, split backward,
constraints), communication.py (where the Comms go), stage_layout.py (THE
stage <-> rank mapping), partition.py (layers per stage), executor.py and
p2p.py (running one rank's list). Nothing here imports megalite.analysis,
which simulates, balances and plans on top of it (README, Architecture).
"""
