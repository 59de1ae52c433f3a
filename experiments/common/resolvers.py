"""OmegaConf resolvers the configs use, registered on import of experiments.common.

${paper_hparam:<table>,<key>,<field>}: one entry of a hyperparameter table keyed by an integer, e.g.
the paper's per-trajectory-count tables: ${paper_hparam:${paper_hparams},${task.num_trajectories},lr}.
${pow2:<base>,<k>}: base * 2**k, the appendix's learning-rate multipliers.
${sweep_folder:${rehearse},${sweep_name}}: a sweep's folder under multirun/ (rehearsals under rehearsal/).
${optim_name:${optim.gp},${optim.ap}}: the optimizer's name, derived from its identity (dopr.optimizer_name).
"""
from omegaconf import OmegaConf

from dopr.names import optimizer_name


def paper_hparam(table, key, field):
    entry = table.get(str(key))
    if entry is None:
        raise KeyError(f"the paper's table has no entry for {key!r} (it has {sorted(table, key=int)})")
    return entry[field]


if not OmegaConf.has_resolver("paper_hparam"):
    OmegaConf.register_new_resolver("paper_hparam", paper_hparam)


def pow2(base, k):
    """${pow2:<base>,<k>}: base * 2**k (the appendix's learning-rate multipliers, eta_base * 2^k)."""
    return float(base) * 2.0 ** float(k)


if not OmegaConf.has_resolver("pow2"):
    OmegaConf.register_new_resolver("pow2", pow2)


def sweep_folder(rehearse, sweep_name):
    """${sweep_folder:${rehearse},${sweep_name}}: the folder under multirun/ of a sweep: its name, and for a
    rehearsal (rehearse=true) rehearsal/<name>, so that a rehearsal never lands among the real runs
    of a paper sweep (multirun/paper_sit/<time>) whose report it would break."""
    return f"rehearsal/{sweep_name}" if str(rehearse).lower() == "true" else str(sweep_name)


if not OmegaConf.has_resolver("sweep_folder"):
    OmegaConf.register_new_resolver("sweep_folder", sweep_folder)


if not OmegaConf.has_resolver("optim_name"):   # the run folder's name (conf/config.yaml): "adamw", "dopr_adamw"
    OmegaConf.register_new_resolver("optim_name", lambda gp, ap: optimizer_name(str(gp), str(ap).lower() == "true"))
