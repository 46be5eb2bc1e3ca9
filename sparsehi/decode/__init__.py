"""The device part of a sparse decode step: its typed state and the per-layer path
(select -> swap_in -> build_table -> attend -> backup / update). See ``decoder.py``."""
from sparsehi.decode.decoder import LayerPlan, SparseDecoder, gathered_attention
from sparsehi.decode.state import CandidateTables, DecodeState

__all__ = ["CandidateTables", "DecodeState", "LayerPlan", "SparseDecoder", "gathered_attention"]
