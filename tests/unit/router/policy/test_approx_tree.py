import random

import pytest

from router.policy.approx_tree import ApproxPrefixTree, ApproxPrefixTrees


def test_match_counts_leading_hashes_of_an_inserted_path():
    tree = ApproxPrefixTree(max_blocks=16)
    tree.insert([1, 2, 3, 4])
    assert tree.match([1, 2, 3, 4]) == 4
    assert tree.match([1, 2, 9, 4]) == 2
    assert tree.match([1, 2, 3, 4, 5, 6]) == 4
    assert tree.match([9, 1, 2]) == 0
    assert tree.match([]) == 0
    assert len(tree) == 4


def test_eviction_removes_least_recently_routed_leaves_first():
    tree = ApproxPrefixTree(max_blocks=5)
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 7])  # refreshes 1, 2 and adds 7: nodes 3 < 7 < 2 < 1 by recency
    assert len(tree) == 4
    tree.insert([10, 11])  # over by one: the oldest leaf (3) goes
    assert [h for h in (1, 2, 3, 7, 10, 11) if h in tree] == [1, 2, 7, 10, 11]
    assert tree.match([1, 2, 3]) == 2
    assert tree.match([1, 2, 7]) == 3
    assert tree.num_evicted == 1


def test_a_path_longer_than_the_bound_keeps_its_prefix():
    tree = ApproxPrefixTree(max_blocks=3)
    tree.insert([1, 2, 3, 4, 5])
    assert tree.match([1, 2, 3, 4, 5]) == 3
    assert tree.num_evicted == 2


def test_resize_evicts_down_to_the_new_bound():
    tree = ApproxPrefixTree(max_blocks=8)
    tree.insert([1, 2, 3, 4])
    tree.resize(2)
    assert tree.match([1, 2, 3, 4]) == 2
    with pytest.raises(ValueError):
        tree.resize(0)
    with pytest.raises(ValueError):
        ApproxPrefixTree(0)


def test_random_inserts_keep_the_tree_prefix_closed_and_match_exact():
    rng = random.Random(5)
    tree = ApproxPrefixTree(max_blocks=40)
    # Paths over a small alphabet, each prefix named by its tuple (as chained hashes are).
    names: dict[tuple, int] = {}
    paths = []
    for _ in range(300):
        path = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 9)))
        hashes = [names.setdefault(path[: i + 1], len(names)) for i in range(len(path))]
        paths.append(hashes)
        tree.insert(hashes)
        assert len(tree) <= 40
        present = {h for h in names.values() if h in tree}
        parents = {hashes_of[i - 1] for hashes_of in paths for i in range(1, len(hashes_of)) if hashes_of[i] in present}
        assert parents <= present  # every present node's parent is present
    for hashes in paths[-50:]:
        linear = next((i for i, h in enumerate(hashes) if h not in tree), len(hashes))
        assert tree.match(hashes) == linear


def test_trees_per_worker():
    trees = ApproxPrefixTrees(max_blocks=4)
    trees.insert(("w1", 0), [1, 2])
    trees.insert(("w1", 1), [1])
    trees.insert(("w2", 0), [5])
    assert trees.num_blocks() == {("w1", 0): 2, ("w1", 1): 1, ("w2", 0): 1}
    trees.resize(1)
    assert trees.get(("w1", 0)).match([1, 2]) == 1
    trees.remove_worker("w1")
    assert trees.num_blocks() == {("w2", 0): 1}
    assert trees.get(("w1", 0)) is None
