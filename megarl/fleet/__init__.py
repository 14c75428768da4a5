"""The trainer's side of the engines (rank 0 owns it).

``fleet`` (the :class:`~megarl.fleet.fleet.Fleet`: start, health, dispatch of prompts over
engines, re-issue after a death), ``updates`` (weight updates: begin → load → commit on every
engine), ``restarts`` (dead engines brought back and rejoined), ``client`` (one
:class:`~megarl.fleet.client.EngineClient` per engine server) and ``faults`` (the test-only
``MEGARL_FAULT`` hook). The engine process itself (``megarl.engine``) never imports this
package.
"""
