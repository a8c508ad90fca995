"""Speculative decoding: proposers guess a request's next tokens, one target step verifies them.

    config.py        SpeculativeConfig (vLLM's `speculative_config`)
    proposer.py      the Proposer interface, the n-gram proposer and the Speculator (policy)
    ngram.py         prompt lookup over the request's own tokens
    draft_model.py   a smaller checkpoint with pools of its own, guessing greedily
    mtp.py           the guesses the checkpoint's MTP layers made at the end of the last step
    verification.py  a verified span's rows -> the tokens that stand (greedy and rejection)
    stats.py         drafts proposed and accepted, per request and per engine

Recurrent state cannot be rewound, so a request that verifies drafts first copies its live
state into a checkpoint slot (cache/recurrent.py); when a draft is rejected the checkpoint is
copied back and the accepted tokens are computed again in the next step, together with that
step's drafts (docs/speculative-decoding.md).
"""
