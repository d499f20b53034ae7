"""Learning: served requests kept (capture.py), a drafter distilled from a frozen target
(distill.py), and `python -m mlx_mtp.learn` / `Engine(learn_every=...)`, which adapt the
drafter to that traffic and keep it only where it is better (learner.py)."""

from .learner import (Adaptation, Learner, Measure, Pool, Progress, adapt, check_out, general_sample, main,
                      parse_args, parser, request_windows, say, split, stdlib, verdict, where_the_time_went,
                      window)
