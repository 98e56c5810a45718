"""The tools built on the engine: the CLI, operator commands, the ops kit, the demo, the drill
and the harness of throwaway servers and child processes they share.

Nothing in the engine (everything in ``pipeline`` outside this package) imports from here;
``lint-imports`` enforces it. A newcomer looking for the delivery path reads ``pipeline.outbox``,
``pipeline.relay``, ``pipeline.transport`` and ``pipeline.inbox``, not this package.
"""
