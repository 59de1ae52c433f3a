"""A tuning arm as a record (gp, ap, variant): the GP, whether DoPr wraps it, and which of its chosen settings
("": its own winner; "at_gp_setting": DoPr at its GP's whole winning setting). The names in summary.json
("optim") and in selection.json / conf/tuned/ are derived from it, and read back into it by :meth:`Arm.read`,
so the committed selections keep resolving."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dopr.names import optimizer_name, split_name

#: the variant of a DoPr arm re-run at its GP's whole winning setting (tuning.py's step 2)
AT_GP_SETTING = "at_gp_setting"


@dataclass(frozen=True)
class Arm:
    gp: str
    ap: bool
    variant: str = ""

    @classmethod
    def read(cls, name: str) -> "Arm":
        """The arm a name stands for: a run's summary.json "optim" ("dopr_adamw") or a chosen setting's name
        ("dopr_adamw_at_gp_setting")."""
        optim = name.removesuffix(f"_{AT_GP_SETTING}")
        return cls(*split_name(optim), AT_GP_SETTING if optim != name else "")

    @property
    def optim(self) -> str:
        """The name its runs record in summary.json: "adamw", "dopr_adamw"."""
        return optimizer_name(self.gp, self.ap)

    @property
    def name(self) -> str:
        """Its name in selection.json and conf/tuned/: the runs' name, then the variant's."""
        return f"{self.optim}_{self.variant}" if self.variant else self.optim

    def but(self, **fields) -> "Arm":
        """The same arm with these fields changed: ``arm.but(ap=False)`` is the GP alone."""
        return dataclasses.replace(self, **fields)
