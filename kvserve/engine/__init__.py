"""Requests, the scheduler and the engine loop (torch-free except the runner it drives).

Files:

- request.py: the request; user_request.py: a user's request (its n sequences) and its
  output (a request the engine failed alone finishes whole, with its error).
- The scheduler: what one step hands on (scheduler_output.py); its limits, policy and
  counters (scheduler_config.py); which waiting request is next (waiting_queue.py); a
  seat taken for a client request holding none (seats.py).
- stop.py: stop checks; detokenizer.py: the incremental detokenizer and a sequence's
  output text; logprobs.py: a sequence's logprobs as output dicts; prompt_input.py: a
  prompt to token ids.
- llm_engine.py: the engine loop (add_request / step / abort_request; shutdown releases
  the runner's weights and pool, then refuses work).
- tiers.py: the external tiers around a step; the content tracker; grammar.py: a
  constrained request's grammar states and the wait for a compile.
- Speculative decoding: `speculative_config` and each request's back-off
  (speculative.py), prompt-lookup drafts (ngram.py), who drafts (a draft model's slots:
  PENDING_DRAFT placeholders), the draft model's loading and the spec_decode counters
  (drafter.py).
- The model-free runner (and its K/V for the tiers: token ids per slot,
  model_free_kv.py), EngineArgs, the engine's counters (engine_stats.py).
"""
