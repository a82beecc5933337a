"""Fault injection for the server tests: put this folder on PYTHONPATH and every process of
the server (its rank processes too, which inherit the environment) raises inside the attention
rank's sampler for any request whose seed is `FAULTY_SEED`, as a bug in one request's sampling
would. Nothing else changes."""

import os

FAULTY_SEED = 4242424242

if os.environ.get("SPLITMOE_TEST_FAULTY_SEED"):
    from splitmoe.attention_nodes import sampler, worker

    _sample = sampler.sample

    def sample(logits, params, *args, **kwargs):
        if any(getattr(p, "seed", None) == FAULTY_SEED for p in params):
            raise RuntimeError("injected fault in one request's sampling (test)")
        return _sample(logits, params, *args, **kwargs)

    sampler.sample = worker.sample = sample  # (the worker imported it by name)
