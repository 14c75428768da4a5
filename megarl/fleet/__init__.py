"""The trainer's side of the engines (rank 0 owns it).

``fleet`` (the :class:`~megarl.fleet.fleet.Fleet`: dispatch of prompts over engines, re-issue
after a death), built on ``lifecycle`` (start, attach, health, lease, shutdown), ``restarts``
(dead engines brought back and rejoined) and ``updates`` (weight updates: begin → load →
commit on every engine); ``protocol`` (the one statement of the weight-update protocol the
transports in ``megarl.weight_sync`` speak to the fleet), ``client`` (one
:class:`~megarl.fleet.client.EngineClient` per engine server) and ``faults`` (the test-only
``MEGARL_FAULT`` hook). The engine process itself (``megarl.engine``) never imports this
package.
"""
