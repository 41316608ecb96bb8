"""The sweep's one answer: the recipe to train with (global batch = per-GPU batch × workers × accumulation, peak LR,
warmup, weight decay and the schedule), the value it is expected to reach, the trials that support it, and the
command that confirms it. From the store alone (metrics.SweepRecord and the spec it logged): `tune`, `report` and
`confirm` build the same answer.

- **The answer is the sweep's best trial** by the sweep's own ranking (metrics.rank: the time to tune.target, then
  tune.metric), so it never contradicts the trials (recipe.py).
- **How the best LR grows with the batch** is fitted from what the trials reached, checked by leaving each batch
  out against the square-root rule and keeping the LR, and bounded by the trials that diverged (fit.py).
- **A batch the sweep did not run** gets the answer's recipe moved along the checked slope, its weight decay through
  AdamW's timescale with one D (predict.py); the answer's own batch is the answer.
- **Confirmations** count only the seeds that finished (confirmations.py); console.py prints all of it.

The records (records.py) are answer.json and the parent run's `answer.*` params and metrics.
"""

from raysweep.answer.fit import MIN_FIT_TRIALS, PRIOR_EXPONENT, fit_lr
from raysweep.answer.predict import predict
from raysweep.answer.recipe import answer_of, confirm_command, model_of, rates, recipe_of, spec_of, throughput_at
from raysweep.answer.records import ANSWER_FILE, METRIC_KEYS, RULES, Answer, Expected, FitCheck, LrFit, Recipe

__all__ = ["ANSWER_FILE", "METRIC_KEYS", "MIN_FIT_TRIALS", "PRIOR_EXPONENT", "RULES", "Answer", "Expected", "FitCheck",
           "LrFit", "Recipe", "answer_of", "confirm_command", "fit_lr", "model_of", "predict", "rates", "recipe_of",
           "spec_of", "throughput_at"]
