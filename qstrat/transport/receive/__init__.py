"""A receiver of transport rounds (inside a vLLM engine through its backend, or standalone).

- :mod:`.receiver`: :func:`receive_round`: one round on a receiver (atomic, bounded, delta, bounded delta)
- :mod:`.handoff`: bounded rounds: reload units handed to the loader as their bytes verify (a
  bounded delta round's from the rebuilt stream), and the MIX a cut-off round leaves
- :mod:`.session`: :class:`ReceiverSession`: a receiver across rounds (secret, address, counter, MIX
  flag, delta base)
- :mod:`.acceptance`: the accept vote's checks
- :mod:`.landing`: where the tensors land: the loader's begin / load / end
- :mod:`.receiver_flag`: a receiver's MIX flag, on the rule of :mod:`qstrat.execute.mix_rule`
- :mod:`.standalone`: :class:`StandaloneReceiver`: a receiver without an engine
"""
