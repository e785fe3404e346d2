"""From a step's logits to tokens: sampling (`sampler.py`), the history-dependent logit
shaping (`penalties.py`), log-probabilities (`logprobs.py`) and structured output's grammars and
token bitmasks (`structured.py`).

May import: `engine.outputs`, `engine.parallel.comm` (host/device copies), `pdmesh.sampling_params`
and `pdmesh.errors`. Never the scheduler, the runner or the models.
"""
