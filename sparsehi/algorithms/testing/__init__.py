"""Author test kit: check a ``BaseSparseAlgorithm`` subclass the way the coordinator will
use it, on small synthetic inputs, in one call::

    from sparsehi.algorithms.testing import check_algorithm
    report = check_algorithm(MyAlgorithm)          # AssertionError with a reason on failure
    print(report)                                  # the numbers

Checks, in order: API conformance (a subclass, ``mode`` set, the four hooks implemented
with the base signatures); a prefill + decode run on a batch with awkward rows (partial
pages, fewer candidates than ``top_k``, an empty candidate range, a ``sparse_mask`` False
row, request slots that are not the batch order) with every ``retrieve_topk`` result
checked (:func:`check_result`: two torch tensors, :func:`~sparsehi.algorithms.base.check_selection`,
padding exactly ``-1``, nothing for masked or padding rows); determinism (same inputs →
same output; prefill of the whole context == prefill + decode); padding rows
(``req_pool_index == -1``, as the unused rows of a CUDA-graph batch) writing nothing and
selecting nothing; decoded keys (for an algorithm whose selection depends on key content:
decoded tokens with keys aligned to the query must get their units selected once those
leave the recent window); capture safety (:mod:`sparsehi.algorithms.graph_safety`:
emulated capture and replay everywhere, a real CUDA graph on CUDA); and recall against the
oracle on planted-needle inputs: the fraction of planted needles selected, and the share of
the best-possible top-k attention mass the selection captures.

Algorithms whose inputs are not the attention queries/keys (DSA: index keys, index

One concern per module: :mod:`.inputs` (what the algorithm is fed), :mod:`.fidelity`
(attention mass, mass recall, planted needles), :mod:`.report` (:class:`AlgorithmReport`),
:mod:`.contract` (API conformance, one result against the contract), :mod:`.harness` (the
synthetic batch and the hook calls made with it), :mod:`.decode_checks` (padding rows,
content dependence, decoded keys), :mod:`.capture` (capture and replay), :mod:`.check`
(:func:`check_algorithm`, the entry point).
"""
from sparsehi.algorithms.testing.check import check_algorithm
from sparsehi.algorithms.testing.contract import check_api, check_result
from sparsehi.algorithms.testing.fidelity import attention_mass, mass_recall, plant_needles
from sparsehi.algorithms.testing.harness import PADDING_ROWS
from sparsehi.algorithms.testing.inputs import AttentionInputs, ProjectedIndexerInputs
from sparsehi.algorithms.testing.report import AlgorithmReport

__all__ = [
    "AlgorithmReport",
    "AttentionInputs",
    "PADDING_ROWS",
    "ProjectedIndexerInputs",
    "attention_mass",
    "check_algorithm",
    "check_api",
    "check_result",
    "mass_recall",
    "plant_needles",
]
