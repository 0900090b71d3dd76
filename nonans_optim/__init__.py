"""nonans_optim: PyTorch optimizers that repair NaN/Inf inside ``step()`` while keeping moments valid.

Public API: the optimizers (``Fusion`` and its presets ``SFNorMuon``, ``FullFusion``, ``Muon``; ``AdamW``,
``SFAdamW``), ``ns5``, ``param_groups``, ``SingularityEvent`` and ``watch``.
"""
from .ns5 import ns5
from .optimizers.adamw import AdamW, SFAdamW
from .optimizers.fusion import FullFusion, Fusion, Muon, SFNorMuon
from .resolution import SingularityEvent
from .routing import param_groups
from .watch import watch

__all__ = ["AdamW", "SFAdamW", "Fusion", "SFNorMuon", "FullFusion", "Muon", "SingularityEvent", "ns5",
           "param_groups", "watch"]
__version__ = "0.1.0"

