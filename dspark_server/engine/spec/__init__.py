"""Speculative decoding inside the native engine: drafting, planning, verification, the step.

``build_speculative`` assembles a ``SpeculativeDecoder`` from an ``EngineConfig``; the engine calls
``SpeculativeDecoder.step`` and commits the ``SpecStepResult`` it returns.
"""

from dspark_server.engine.spec.decoder import RequestTokens, SpecStepResult, SpeculativeDecoder
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.engine.spec.setup import build_speculative

__all__ = ["RequestTokens", "RoundRecord", "SpecStepResult", "SpeculativeDecoder", "build_speculative"]
