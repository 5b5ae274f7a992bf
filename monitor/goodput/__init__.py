"""The goodput ledger (docs/goodput.md): where the job's replica-seconds went, by cause and by
incident. :class:`GoodputLedger` accounts each sweep; :class:`GoodputWriter` saves it."""

from .account import GoodputWriter
from .ledger import GoodputLedger
from .model import CAUSES, GoodputConfig, SweepAccount

__all__ = ["CAUSES", "GoodputConfig", "GoodputLedger", "GoodputWriter", "SweepAccount"]
