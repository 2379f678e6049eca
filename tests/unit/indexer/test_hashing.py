import subprocess
import sys
from array import array

import pytest
import xxhash

from indexer.hashing import hash_block, hash_blocks, hash_prompt, namespace_root, token_array, token_bytes


def test_full_blocks_only_and_chained():
    tokens = list(range(10))
    hashes = hash_prompt(tokens, 4, model="m")
    assert len(hashes) == 2
    root = namespace_root("m")
    assert hashes[0] == hash_block(root, tokens[0:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])


def test_known_values_pin_the_encoding():
    # The encoding is a wire contract between router and workers: pin it.
    root = namespace_root("m", None)
    assert root == xxhash.xxh3_64_intdigest(b"m\x00")
    assert hash_block(root, [1, 2]) == xxhash.xxh3_64_intdigest(b"\x01\x00\x00\x00\x02\x00\x00\x00", root)


def test_prefix_property():
    a = list(range(100))
    b = a[:64] + [7] * 36
    ha, hb = hash_prompt(a, 16), hash_prompt(b, 16)
    assert ha[:4] == hb[:4]
    assert ha[4] != hb[4]


def test_namespaces_never_collide():
    tokens = list(range(32))
    assert hash_prompt(tokens, 16, "a") != hash_prompt(tokens, 16, "b")
    assert hash_prompt(tokens, 16, "a") != hash_prompt(tokens, 16, "a", "lora1")
    assert namespace_root("ab", None) != namespace_root("a", "b")


def test_num_blocks_cap_and_short_prompts():
    tokens = list(range(64))
    assert hash_blocks(tokens, 16, 0, num_blocks=2) == hash_blocks(tokens, 16, 0)[:2]
    assert hash_prompt(tokens[:15], 16) == []
    with pytest.raises(ValueError):
        hash_blocks(tokens, 0, 0)


def test_array_and_list_inputs_agree():
    tokens = [5, 70000, 2**32 - 1, 0] * 8
    assert hash_prompt(tokens, 4) == hash_prompt(token_array(tokens), 4)
    assert token_bytes(token_array(tokens)) == token_bytes(tokens)
    assert token_array(array("I", tokens)).tolist() == tokens


def test_bytes_are_one_token_per_byte():
    assert token_array(b"\x01\x02\x03\x04").tolist() == [1, 2, 3, 4]
    assert hash_prompt(b"abcd", 2) == hash_prompt([97, 98, 99, 100], 2)


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_out_of_range_token_ids_rejected(bad):
    with pytest.raises(ValueError):
        token_bytes(bad)


def test_deterministic_across_processes():
    code = "from indexer.hashing import hash_prompt; print(hash_prompt(list(range(64)), 16, 'model-x'))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2")
    }
    assert runs == {str(hash_prompt(list(range(64)), 16, "model-x")) + "\n"}
