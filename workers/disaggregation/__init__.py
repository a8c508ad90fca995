"""Engine roles for disaggregated serving: prefill hands requests off, decode receives them.

    prefill engine                             decode engine
    prompt computed, first token sampled
    hand_off: the request leaves the           prepare: validate; share the prefix blocks it
      scheduler but keeps its blocks and         already caches; allocate the rest and a live
      live slot, under a lease                   slot (the request waits, unschedulable)
           ---- KV blocks [held, n) + live Mamba state after the prompt (state_pos) ---->
    release on ack / abort / lease expiry      complete: cursor = prompt length; it joins the
                                                 running requests and decodes the first token
                                               fail: recompute locally or end with an error;
                                                 the destination pages stay quarantined until
                                                 no write can still be filling them

Ownership: prefill pages belong to the handoff until one of its three release events; while a
send reads them they are pinned, and a release that comes meanwhile (lease, abort) waits for
the send to end (`unpin`): freed pages may be reallocated and overwritten at once. Decode pages
belong to the receiving request, then to a quarantine, never straight to the pool while a
writer may be active.

A send pins its handoff's pages without the engine's lock (`PrefillPort.handoff_source`): the
engine holds that lock for a whole step, and a prefill step can last a second on a busy CPU,
which every transfer would wait through before its first byte. The pages are known from the
hand-off, and a small lock of the handoffs' own makes pinning and releasing exclusive.
"""
