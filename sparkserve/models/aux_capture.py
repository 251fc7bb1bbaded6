"""Aux hidden-state capture (DSpark taps): id l = output of decoder layer l, the same as HF's
`hidden_states[l + 1]`; id -1 = the embedding output (`hidden_states[0]`). Shared by every model
so the rule and its checks live in one place."""
from __future__ import annotations


class AuxCaptureMixin:
    aux_layer_ids: list[int]
    aux_layer_set: frozenset[int]

    def init_aux_capture(self, num_layers: int) -> None:
        self._num_aux_candidate_layers = num_layers
        self.aux_layer_ids = []
        self.aux_layer_set = frozenset()

    def set_aux_layers(self, layer_ids: list[int]) -> None:
        n = self._num_aux_candidate_layers
        ids = list(layer_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids must be unique, got {ids}")
        for l in ids:
            if not isinstance(l, int) or not -1 <= l < n - 1:
                raise ValueError(f"aux layer id {l} out of range: must be in [-1, {n - 2}] "
                                 f"(the last layer, {n - 1}, is the model output and cannot be tapped)")
        if ids != sorted(ids):
            raise ValueError(f"aux layer ids must be increasing, got {ids}")
        self.aux_layer_ids = ids
        self.aux_layer_set = frozenset(ids)

    set_dspark_layers_to_capture = set_aux_layers
