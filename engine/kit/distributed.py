"""What a strategy plugin builds on: the strategy interface and the launcher's ranks.

Subclass :class:`DistributedStrategy` (process group, reductions, barriers, broadcasts) and
override what differs (wrapping, backward, checkpoint I/O); register it with the
``register_strategies`` hook. :func:`strategy_name` is the run's strategy with ``"auto"``
resolved; :func:`env_rank` and :func:`is_main_process` read the launcher's environment before
the strategy is set up.
"""

from ..rundir import env_rank, is_main_process
from ..strategy import DistributedStrategy, Strategy, strategy_name

__all__ = ["DistributedStrategy", "Strategy", "strategy_name", "env_rank", "is_main_process"]
