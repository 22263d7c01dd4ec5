"""Token trees as flat arrays: candidate trees, selection, layout, verification.

Pure functions over small arrays and tensors; imports only torch, numpy and the stdlib.
"""

from __future__ import annotations

from adaserve.tree.candidate import (
    CandidateTree,
    beam_search_step,
    expand_step,
    merge_trees,
    subtree,
    top_chain,
)
from adaserve.tree.layout import (
    VerifyTree,
    ancestor_mask,
    build_verify_tree,
    chain_parents,
    tree_attention_mask,
)
from adaserve.tree.select import (
    adaserve_select,
    equal_greedy_select,
    global_greedy_select,
    required_accepts,
    select_all,
    slo_customized_select,
    throughput_optimized_select,
    tree_shape,
)
from adaserve.tree.verify import (
    is_greedy,
    target_probs,
    verify,
    verify_greedy,
    verify_sampling,
    walk_greedy,
)

__all__ = [
    "CandidateTree",
    "VerifyTree",
    "adaserve_select",
    "ancestor_mask",
    "beam_search_step",
    "build_verify_tree",
    "chain_parents",
    "equal_greedy_select",
    "expand_step",
    "global_greedy_select",
    "merge_trees",
    "required_accepts",
    "select_all",
    "slo_customized_select",
    "subtree",
    "target_probs",
    "throughput_optimized_select",
    "tree_attention_mask",
    "top_chain",
    "tree_shape",
    "verify",
    "verify_greedy",
    "walk_greedy",
    "is_greedy",
    "verify_sampling",
]
