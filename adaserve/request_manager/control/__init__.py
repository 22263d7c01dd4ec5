"""Speculation control: the forward cost model, the acceptance calibration, the controller
that decides each iteration whether to draft and what to verify, and the latency profile
that seeds them (B, t_spec, the baseline latency)."""
