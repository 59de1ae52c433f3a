"""Image-based robot policy learning on robomimic (section "Image-Based Robot Policy Learning")."""
import logging as _logging

# robosuite logs through its own stderr handler and also propagates to the root logger, which
# Hydra's job logging prints again: every robosuite line twice (inside the progress bar). Its own
# handler alone prints each once; set before robosuite is first imported (its import already logs).
_logging.getLogger("robosuite_logs").propagate = False
