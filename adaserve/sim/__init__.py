"""`adaserve simulate`: the project's own scheduler on a virtual clock.

The scheduler, the selection, speculation control, chunked prefill and the paged KV
bookkeeping run unchanged; only the engine is simulated (`engine.py`): a forward advances a
virtual clock by a cost model's time (`cost.py`: a measured profile, or a roofline model of a
GPU and a model config) and returns logits that make the target's greedy choice a known
function of (token, position). Candidate trees come from a synthetic drafter whose draft
probabilities and acceptance follow a recorded or a parametric acceptance model
(`acceptance.py`). `run.py` replays a trace and writes the same report as `adaserve bench`.
"""
