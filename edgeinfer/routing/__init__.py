"""Edge-cloud routing: answer on the device what the small model can, send the rest to a cloud model.

- ``router``: ``Router``, which wraps an ``Engine`` and a ``CloudModel`` with the engine's call shape;
- ``cloud``: the OpenAI-compatible client, bounded and cancellable;
- ``signals``: the escalation score and the signals it weighs;
- ``calibration``: thresholds and weights fitted to graded answers;
- ``privacy``: the rules that keep a prompt on the device.
"""
