"""HF → loopjax conversion: round trips of both golden checkpoints (params equal to the key
tables' `to_params`, logits equal to the PyTorch goldens), sharded input, the bf16 cast, and
every bad input giving one stderr line, exit status 2 and no output folder left behind."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import loopjax
from loopjax import checkpoint, cli
from loopjax.config import ConfigError, config_from_hf, read_hf_config
from loopjax.convert import converter, huginn_keys, ouro_keys, safetensors_reader
from loopjax.model import Model, forward

DATA = os.path.join(os.path.dirname(__file__), "data")
OURO = os.path.join(DATA, "ouro")
HUGINN = os.path.join(DATA, "huginn", "huginn_shape_242")
RTOL = 1e-4


def convert_cli(*argv) -> int:
    return cli.main(["convert", *argv, "--no-progress"])


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max())


def assert_trees_equal(got, want):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for a, b in zip(got_leaves, want_leaves):
        assert a.shape == b.shape and np.dtype(a.dtype) == np.dtype(b.dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def copy_hf(src, dst):
    """A writable copy of a golden HF folder (config + weights + generation config)."""
    os.makedirs(dst)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return str(dst)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Both goldens converted once in fp32 through the CLI."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for name, src in (("ouro", OURO), ("huginn", HUGINN)):
        assert convert_cli(src, str(root / name), "--dtype", "float32") == 0
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("family,src,keys", [("ouro", OURO, ouro_keys), ("huginn", HUGINN, huginn_keys)])
def test_round_trip_params_equal_to_params(converted, family, src, keys):
    cfg, params = checkpoint.restore(converted[family])
    assert cfg == read_hf_config(src)
    want = keys.to_params(cfg, load_file(os.path.join(src, "model.safetensors")))
    assert_trees_equal(params, want)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            with open(os.path.join(src, name), "rb") as a:
                with open(os.path.join(converted[family], name), "rb") as b:
                    assert a.read() == b.read()


def test_ouro_converted_logits_match_golden(converted):
    cfg, params = checkpoint.restore(converted["ouro"])
    ref = np.load(os.path.join(OURO, "reference_fp32.npz"))
    out = forward(Model(cfg, params), ref["p0_input_ids"])
    assert relative_error(out.logits, ref["p0_logits"]) < RTOL


def test_huginn_converted_logits_match_golden(converted):
    cfg, params = checkpoint.restore(converted["huginn"])
    inputs = load_file(os.path.join(HUGINN, "inputs.safetensors"))
    golden = load_file(os.path.join(HUGINN, "forward.safetensors"))
    out = forward(Model(cfg, params), inputs["prompt_ids"][0], loops=8, initial_state=inputs["init_state"][0])
    assert relative_error(out.logits, golden["logits_steps8"][0]) < RTOL


def test_huginn_checkpoint_with_one_adapter_restores_split(tmp_path, converted):
    """A Huginn checkpoint written before the adapter's halves were separate buffers (one
    "adapter" [2H, H]) restores into today's params: adapter_state, adapter_input."""
    import orbax.checkpoint as ocp

    cfg, params = checkpoint.restore(converted["huginn"])
    params = jax.tree.map(np.asarray, params)
    legacy = {k: v for k, v in params.items() if not k.startswith("adapter_")}
    legacy["adapter"] = np.concatenate([params["adapter_state"], params["adapter_input"]], axis=0)
    folder = tmp_path / "legacy"
    shutil.copytree(converted["huginn"], folder, ignore=shutil.ignore_patterns(checkpoint.PARAMS_DIR))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(folder / checkpoint.PARAMS_DIR), legacy)
        checkpointer.wait_until_finished()
    _, restored = checkpoint.restore(str(folder))
    assert_trees_equal(restored, params)
    assert not np.array_equal(params["adapter_state"], params["adapter_input"])


def test_bf16_conversion_casts(tmp_path, converted):
    out = str(tmp_path / "bf16")
    assert convert_cli(HUGINN, out) == 0  # bfloat16 is the default
    assert checkpoint.stored_dtype(out) == np.dtype(ml_dtypes.bfloat16)
    _, params = checkpoint.restore(out)
    _, params32 = checkpoint.restore(converted["huginn"])
    assert_trees_equal(params, jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), params32))
    _, widened = checkpoint.restore(out, dtype="float32")  # restore-time cast
    assert np.dtype(widened["embed"].dtype) == np.float32
    auto = str(tmp_path / "auto")
    umask = os.umask(0o077)  # a private user's: the folder is theirs alone (it was 0o755 whatever the umask)
    try:
        assert convert_cli(HUGINN, auto, "--dtype", "auto") == 0  # the input's own dtype (fp32 here)
    finally:
        os.umask(umask)
    assert checkpoint.stored_dtype(auto) == np.float32
    assert os.stat(auto).st_mode & 0o777 == 0o700 and os.stat(out).st_mode & 0o777 == 0o777 & ~umask


def test_sharded_input_equals_single_file(tmp_path, converted):
    tensors = load_file(os.path.join(OURO, "model.safetensors"))
    hf = tmp_path / "sharded"
    os.makedirs(hf)
    shutil.copyfile(os.path.join(OURO, "config.json"), hf / "config.json")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(hf / file))
        weight_map.update({n: file for n in members})
    with open(hf / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    out = str(tmp_path / "out")
    assert convert_cli(str(hf), out, "--dtype", "float32") == 0
    assert_trees_equal(checkpoint.restore(out)[1], checkpoint.restore(converted["ouro"])[1])


def test_output_parents_are_created(tmp_path):
    out = tmp_path / "a" / "b" / "ouro"
    assert convert_cli(OURO, str(out)) == 0
    assert checkpoint.is_checkpoint(str(out))


def test_a_parent_that_cannot_be_made_is_one_line_and_none_is_left(tmp_path, capsys):
    """Parents a/bbb...b (300 characters): 'a' was made and left behind when the next one failed,
    and the line was Python's '[Errno 36] File name too long: ...' naming the parent."""
    out = tmp_path / "a" / ("b" * 300) / "out"
    assert convert_cli(OURO, str(out)) == 2
    assert capsys.readouterr().err == f"loopjax convert: error: cannot write {out}: File name too long\n"
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- bad inputs


def write_hf(folder, config, tensors):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def golden_parts(src):
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    return config, load_file(os.path.join(src, "model.safetensors"))


def make_missing_tensor(hf):
    config, tensors = golden_parts(OURO)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_hf(hf, config, tensors)
    return "model.layers.1.mlp.up_proj.weight"


def make_extra_tensor(hf):
    config, tensors = golden_parts(OURO)
    tensors["model.layers.7.mystery.weight"] = np.zeros(3, np.float32)
    write_hf(hf, config, tensors)
    return "model.layers.7.mystery.weight"


def make_wrong_shape(hf):
    config, tensors = golden_parts(OURO)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    write_hf(hf, config, tensors)
    return "(32, 64), expected (64, 64)"


def make_integer_tensor(hf):
    config, tensors = golden_parts(OURO)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    write_hf(hf, config, tensors)
    return "tensor 'model.norm.weight' has dtype int32, expected a float dtype"


def make_truncated(hf):
    copy_hf(OURO, hf)
    path = os.path.join(hf, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    return "model.safetensors is truncated"


def make_corrupt_header(hf):
    copy_hf(OURO, hf)
    with open(os.path.join(hf, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"#not json#")
    return "model.safetensors is corrupt"


def edit_header(hf, edit):
    """A copy of the Ouro golden whose model.safetensors header `edit(header)` changed in place."""
    copy_hf(OURO, hf)
    path = os.path.join(hf, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    edit(header)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data[8 + size:])


def make_header_dtype_not_a_name(hf):
    def edit(header):
        header["model.norm.weight"]["dtype"] = ["F32"]  # was a TypeError traceback (unhashable)

    edit_header(hf, edit)
    return "model.safetensors: tensor 'model.norm.weight' has unsupported dtype ['F32']"


def make_overlapping_offsets(hf):
    def edit(header):  # two norms of one shape read the same bytes: it converted, one weight lost
        norm = "model.layers.0.input_layernorm"
        header[norm + "_2.weight"]["data_offsets"] = header[norm + ".weight"]["data_offsets"]

    edit_header(hf, edit)
    return ("model.safetensors is corrupt: tensors 'model.layers.0.input_layernorm.weight' and "
            "'model.layers.0.input_layernorm_2.weight' overlap in the file")


def make_offset_not_an_integer(hf):
    def edit(header):  # 1e400 or Infinity in the JSON: int() raised an OverflowError traceback
        header["model.norm.weight"]["data_offsets"][1] = float("inf")

    edit_header(hf, edit)
    return "model.safetensors is corrupt: bad header entry for tensor 'model.norm.weight'"


def make_garbage_file(hf):
    copy_hf(OURO, hf)
    with open(os.path.join(hf, "model.safetensors"), "wb") as f:
        f.write(b"\xff" * 64)
    return "model.safetensors is truncated or corrupt"


def make_unsupported_type(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "model_type": "llama"}, tensors)
    return "unsupported model_type 'llama'; loopjax supports: huginn_raven, ouro"


def make_list_model_type(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "model_type": ["ouro"]}, tensors)  # was a TypeError traceback (unhashable)
    return "unsupported model_type ['ouro']; loopjax supports: huginn_raven, ouro"


def make_config_not_object(hf):
    _, tensors = golden_parts(OURO)
    write_hf(hf, ["ouro"], tensors)
    return "config.json must hold a JSON object, got list"


def make_ouro_layers_beyond_the_tensors(hf):
    config, tensors = golden_parts(OURO)  # a typo'd count: its name table took seconds (10**9: memory)
    write_hf(hf, {**config, "num_hidden_layers": 100000}, tensors)
    return "config.json declares 100000 layers, but the checkpoint holds 27 tensors in all"


def make_huginn_layers_beyond_the_tensors(hf):
    config, tensors = golden_parts(HUGINN)
    write_hf(hf, {**config, "n_layers_in_coda": 100000}, tensors)
    return "config.json declares 100006 layers, but the checkpoint holds 77 tensors in all"


def make_zero_heads(hf):
    config, tensors = golden_parts(OURO)
    del config["head_dim"]
    write_hf(hf, {**config, "num_attention_heads": 0}, tensors)
    return "hidden_size 64 and num_attention_heads 0 must be positive integers"


def make_no_context(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "max_position_embeddings": 0}, tensors)
    return "max_position_embeddings must be a positive integer, got 0"


def make_null_rope_theta(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "rope_theta": None}, tensors)
    return "ouro config: rope_theta must be a number, got None"


def make_string_exit_step(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "early_exit_step": "1"}, tensors)
    return "ouro config: early_exit_step '1' is outside 0..3"


def make_string_exit_threshold(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "early_exit_threshold": "0.5"}, tensors)  # was run as 0.5
    return "ouro config: early_exit_threshold must be null or a number in [0, 1], got '0.5'"


def make_null_huginn_prelude(hf):
    config, tensors = golden_parts(HUGINN)
    write_hf(hf, {**config, "n_layers_in_prelude": None}, tensors)
    return "huginn config: num_prelude_layers must be a non-negative integer, got None"


def make_null_mean_recurrence(hf):
    config, tensors = golden_parts(HUGINN)
    write_hf(hf, {**config, "mean_recurrence": None}, tensors)
    return "huginn config: mean_recurrence must be a positive integer, got None"


def make_rope_scaling(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, tensors)
    return "ouro config: rope_scaling of type 'yarn' is not supported"


def make_sliding_window_layers(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "use_sliding_window": True, "sliding_window": 64,
                  "layer_types": ["full_attention", "sliding_attention"]}, tensors)
    return "ouro config: layer_types 'sliding_attention' is not supported"


def make_layer_types_not_a_list(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "layer_types": True}, tensors)  # was a TypeError traceback
    return "ouro config: layer_types must be a list of layer types, got True"


def make_list_bos(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "bos_token_id": [1]}, tensors)  # converted; then forward: unhashable config
    return "ouro config: bos_token_id must be a token id or null, got [1]"


def make_huginn_dict_pad(hf):
    config, tensors = golden_parts(HUGINN)
    write_hf(hf, {**config, "pad_token_id": {"id": 0}}, tensors)
    return "huginn config: pad_token_id must be a token id or null, got {'id': 0}"


def make_gelu_activation(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "hidden_act": "gelu"}, tensors)
    return "ouro config: hidden_act 'gelu' is not supported (loopjax runs SiLU)"


def make_utf16_config(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, config, tensors)
    with open(os.path.join(hf, "config.json"), "w", encoding="utf-16") as f:  # a Windows editor's save
        json.dump(config, f)
    return "config.json is not valid JSON: 'utf-8' codec can't decode"


def make_generation_config_not_object(hf):
    copy_hf(OURO, hf)
    with open(os.path.join(hf, "generation_config.json"), "w") as f:
        json.dump([{"eos_token_id": 2}], f)
    return "generation_config.json in the input folder is not a JSON object"


def make_tokenizer_not_a_tokenizer(hf):
    copy_hf(OURO, hf)
    with open(os.path.join(hf, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "model": "none"}, f)  # JSON, but no tokenizer
    return "tokenizer.json in the input folder is not a tokenizer"


def make_string_eos(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, {**config, "eos_token_id": "2"}, tensors)
    return "ouro config: eos_token_id must be a token id or a list of them, got '2'"


def make_generation_config_bad_eos(hf):
    copy_hf(OURO, hf)
    with open(os.path.join(hf, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, None]}, f)
    return "generation_config.json: eos_token_id must be a token id or a list of them, got [2, None]"


def make_chat_template_not_utf8(hf):
    copy_hf(OURO, hf)
    with open(os.path.join(hf, "chat_template.jinja"), "w", encoding="utf-16") as f:
        f.write("{{ messages[0]['content'] }}")
    return "chat_template.jinja in the input folder is not UTF-8 text"


def make_no_config(hf):
    copy_hf(OURO, hf)
    os.remove(os.path.join(hf, "config.json"))
    return "no config.json in"


def make_no_weights(hf):
    copy_hf(OURO, hf)
    os.remove(os.path.join(hf, "model.safetensors"))
    return "no model.safetensors or model.safetensors.index.json"


def make_pytorch_weights_only(hf):
    make_no_weights(hf)
    with open(os.path.join(hf, "pytorch_model.bin"), "wb") as f:
        f.write(b"PK")
    return "no model.safetensors or model.safetensors.index.json in " + hf + " (pytorch_model.bin is not read"


def make_snapshot_copied_without_blobs(hf):
    """A Hub snapshot's files are links to ../../blobs/HASH: copied alone, they point nowhere.
    The line said there was no model.safetensors (a broken tokenizer.json was skipped)."""
    make_no_weights(hf)
    os.symlink("../../blobs/6a5c", os.path.join(hf, "model.safetensors"))
    return f"{hf}/model.safetensors is a broken link: its target ../../blobs/6a5c is missing"


def make_tokenizer_a_broken_link(hf):
    copy_hf(OURO, hf)
    os.symlink("../../blobs/9f0e", os.path.join(hf, "tokenizer.json"))
    return f"{hf}/tokenizer.json is a broken link: its target ../../blobs/9f0e is missing"


def make_already_converted(hf):
    copy_hf(OURO, hf)
    os.remove(os.path.join(hf, "model.safetensors"))
    with open(os.path.join(hf, checkpoint.CONFIG_FILE), "w") as f:
        f.write("{}")
    return "(it is a loopjax checkpoint already)"


def make_missing_folder(hf):
    return "hf does not exist"


def make_file_not_folder(hf):
    with open(hf, "w") as f:
        f.write("{}")
    return "hf is not a folder"


def make_index_missing_shard(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, config, {})
    os.remove(os.path.join(hf, "model.safetensors"))
    save_file(tensors, os.path.join(hf, "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in tensors}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return "names shard 'model-00002-of-00002.safetensors', which is not a file"


def make_index_shard_not_a_name(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, config, {})
    os.remove(os.path.join(hf, "model.safetensors"))
    save_file(tensors, os.path.join(hf, "a.safetensors"))
    weight_map = {n: ["a.safetensors"] for n in tensors}
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return "index.json is corrupt: weight_map names shard ['a.safetensors'], not a file name"


def make_index_tensor_not_in_shard(hf):
    config, tensors = golden_parts(OURO)
    write_hf(hf, config, {})
    os.remove(os.path.join(hf, "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:-1]}, os.path.join(hf, "a.safetensors"))
    save_file({names[-1]: tensors[names[-1]]}, os.path.join(hf, "b.safetensors"))
    weight_map = {n: "a.safetensors" for n in names}  # the last one is really in b
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return f"puts tensor {names[-1]!r} in a.safetensors, which does not contain it"


def make_untied_huginn(hf):
    config, tensors = golden_parts(HUGINN)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    write_hf(hf, config, tensors)
    return "lm_head.weight differs from transformer.wte.weight"


def make_tied_ouro_head_differs(hf):
    config, tensors = golden_parts(OURO)  # the golden's lm_head differs from its embedding
    write_hf(hf, {**config, "tie_word_embeddings": True}, tensors)
    return "lm_head.weight differs from model.embed_tokens.weight"


BAD_INPUTS = [make_missing_tensor, make_extra_tensor, make_wrong_shape, make_integer_tensor, make_truncated,
              make_corrupt_header, make_header_dtype_not_a_name, make_overlapping_offsets,
              make_offset_not_an_integer, make_garbage_file, make_unsupported_type,
              make_list_model_type, make_config_not_object,
              make_ouro_layers_beyond_the_tensors, make_huginn_layers_beyond_the_tensors,
              make_zero_heads, make_no_context, make_null_rope_theta, make_string_exit_step,
              make_string_exit_threshold,
              make_null_huginn_prelude, make_null_mean_recurrence, make_rope_scaling,
              make_sliding_window_layers, make_layer_types_not_a_list, make_list_bos,
              make_huginn_dict_pad, make_gelu_activation, make_utf16_config,
              make_generation_config_not_object, make_tokenizer_not_a_tokenizer, make_string_eos,
              make_generation_config_bad_eos, make_chat_template_not_utf8, make_no_config,
              make_no_weights, make_pytorch_weights_only, make_snapshot_copied_without_blobs,
              make_tokenizer_a_broken_link, make_already_converted, make_missing_folder, make_file_not_folder,
              make_index_missing_shard, make_index_shard_not_a_name,
              make_index_tensor_not_in_shard, make_untied_huginn, make_tied_ouro_head_differs]


@pytest.mark.parametrize("make", BAD_INPUTS, ids=lambda f: f.__name__[5:])
def test_bad_input_one_line_exit_2_no_output(make, tmp_path, capsys):
    hf = str(tmp_path / "hf")
    expected = make(hf)
    out_parent = tmp_path / "outputs"
    out_parent.mkdir()
    assert convert_cli(hf, str(out_parent / "model")) == 2
    err = capsys.readouterr().err
    assert err.startswith("loopjax convert: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert os.listdir(out_parent) == []  # neither the output nor a temporary folder


def test_existing_output_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert_cli(OURO, str(out)) == 2
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]


def test_existing_output_file_is_named_a_file(tmp_path, capsys):
    """An OUT_DIR that is a regular file was reported as 'output folder ... already exists'."""
    out = tmp_path / "out"
    out.write_text("mine")
    assert convert_cli(OURO, str(out)) == 2
    assert capsys.readouterr().err == f"loopjax convert: error: output {out} is an existing file\n"
    assert out.read_text() == "mine"


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    def failing_save(path, cfg, params):
        with open(os.path.join(path, "partial"), "w") as f:
            f.write("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save", failing_save)
    assert convert_cli(OURO, str(tmp_path / "new" / "out")) == 2
    assert os.listdir(tmp_path) == []  # the temporary folder and the created parent are gone


def test_ctrl_c_while_writing_is_one_line_exit_130_nothing_left(tmp_path, monkeypatch, capsys):
    def interrupted_save(path, cfg, params):
        with open(os.path.join(path, "partial"), "w") as f:
            f.write("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save", interrupted_save)
    assert convert_cli(OURO, str(tmp_path / "new" / "out")) == 130
    err = capsys.readouterr().err
    assert err.startswith("loopjax convert: ") and "interrupted" in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []  # the temporary folder and the created parent are gone


def test_unwritable_output_folder_names_the_output(tmp_path, monkeypatch, capsys):
    """A read-only parent folder: the line named the hidden temporary folder the user never
    asked for ('.out.tmp-x1y2'), not the output."""
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".out.tmp-x1y2"))

    monkeypatch.setattr(converter.tempfile, "mkdtemp", read_only)
    assert convert_cli(OURO, str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err == f"loopjax convert: error: cannot write {tmp_path / 'out'}: Permission denied\n"
    assert os.listdir(tmp_path) == []


def test_undecodable_loopjax_config_is_one_line(tmp_path, converted):
    folder = tmp_path / "ckpt"
    shutil.copytree(converted["ouro"], folder)
    with open(folder / checkpoint.CONFIG_FILE, "rb") as f:
        text = f.read().decode()
    (folder / checkpoint.CONFIG_FILE).write_bytes(text.encode("utf-16"))
    with pytest.raises(checkpoint.CheckpointError, match=r"loopjax_config.json is not valid JSON"):
        checkpoint.read_config(str(folder))


@pytest.mark.parametrize("text", ['"ouro"', "[]"])
def test_loopjax_config_not_an_object_is_one_line_naming_it(tmp_path, converted, text):
    """It was a bare 'dictionary update sequence element #0 has length 1' ValueError, or
    'unsupported model_type None' for a list."""
    folder = tmp_path / "ckpt"
    shutil.copytree(converted["ouro"], folder)
    (folder / checkpoint.CONFIG_FILE).write_text(text)
    with pytest.raises(checkpoint.CheckpointError, match=r"loopjax_config.json is not a valid loopjax "
                                                         r"config: not a JSON object"):
        checkpoint.read_config(str(folder))


def test_python_m_entry_point(tmp_path):
    result = subprocess.run([sys.executable, "-m", "loopjax.convert", str(tmp_path / "nope"),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("loopjax convert: error: ") and "does not exist" in result.stderr


def test_tied_ouro_with_or_without_stored_head(tmp_path):
    """A tied Ouro checkpoint loads whether or not the exporter also stored the duplicate
    `lm_head.weight` (HF's save drops it, others keep it); the head is the embedding."""
    config, tensors = golden_parts(OURO)
    config["tie_word_embeddings"] = True
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    write_hf(str(tmp_path / "with"), config, tensors)
    del tensors["lm_head.weight"]
    write_hf(str(tmp_path / "without"), config, tensors)
    _, with_head = converter.load_hf(str(tmp_path / "with"), progress=False)
    _, without_head = converter.load_hf(str(tmp_path / "without"), progress=False)
    assert_trees_equal(with_head, without_head)
    np.testing.assert_array_equal(with_head["lm_head"], tensors["model.embed_tokens.weight"].T)


def test_ouro_rope_theta_from_transformers_5_rope_parameters():
    """transformers 5 writes rope_theta inside `rope_parameters`; it must not fall back to the
    default 1e6 (the golden's 1e4 would give other logits)."""
    config, _ = golden_parts(OURO)
    del config["rope_theta"], config["rope_scaling"]
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    assert config_from_hf(config) == read_hf_config(OURO)


def test_huginn_config_fields_the_reference_honours_are_refused_by_name():
    """test_time_noise, an adapter bias and grouped kv heads change the reference's logits; they
    were ignored (the noise) or failed on a tensor's name or shape."""
    config, _ = golden_parts(HUGINN)
    assert config_from_hf({**config, "test_time_noise": 0, "bias": False}).num_heads == 4
    for field, value, message in (
            ("test_time_noise", 0.5, "test_time_noise 0.5 is not supported"),
            ("bias", True, "bias true (an adapter bias) is not supported"),
            ("num_key_value_heads", 2, "num_key_value_heads 2 other than n_heads 4 is not supported")):
        with pytest.raises(ConfigError, match=f"^huginn config: {re.escape(message)}"):
            config_from_hf({**config, field: value})


def test_check_tensor_names_lists_unexpected_and_ignores_patterns():
    expected = {"a": (2,), "b": (3,)}
    converter.check_tensor_names({"a": (2,), "b": (3,), "rope.inv_freq": (4,)}, expected,
                                 is_ignored=lambda n: n.endswith("inv_freq"))
    with pytest.raises(converter.ConvertError, match=r"unexpected tensor 'c' \(and 1 more\)"):
        converter.check_tensor_names({"a": (2,), "b": (3,), "c": (1,), "d": (1,)}, expected)
    with pytest.raises(converter.ConvertError, match=r"'o' has shape \(5,\), expected \(6,\)"):
        converter.check_tensor_names({"a": (2,), "b": (3,), "o": (5,)}, expected, optional={"o": (6,)})


def test_bf16_hf_checkpoint_reads_and_widens(tmp_path):
    """Released checkpoints are bf16 (a dtype numpy lacks): read, keep by default, or widen."""
    config, tensors = golden_parts(HUGINN)
    bf16 = {name: value.astype(ml_dtypes.bfloat16) for name, value in tensors.items()}
    write_hf(str(tmp_path), config, bf16)
    refs = safetensors_reader.open_checkpoint(str(tmp_path))
    assert refs["transformer.wte.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    cfg, params = converter.load_hf(str(tmp_path), progress=False)  # default: the checkpoint's dtype
    want = huginn_keys.to_params(cfg, bf16)
    assert_trees_equal(params, want)
    _, widened = converter.load_hf(str(tmp_path), dtype="float32", progress=False)
    assert_trees_equal(widened, jax.tree.map(lambda a: a.astype(np.float32), want))


def test_an_ignored_tensor_does_not_choose_the_default_dtype(tmp_path):
    """fp32 weights beside a bf16 RoPE table (never read) were 'mixed', so loaded as bf16."""
    config, tensors = golden_parts(HUGINN)
    tensors["freqs_cis"] = tensors["freqs_cis"].astype(ml_dtypes.bfloat16)
    write_hf(str(tmp_path), config, tensors)
    _, params = converter.load_hf(str(tmp_path), progress=False)
    assert params["embed"].dtype == np.float32


def test_progress_bar_for_large_checkpoints(monkeypatch, capsys):
    converter.load_hf(OURO, progress=True)
    assert "reading tensors" not in capsys.readouterr().err  # small: no bar
    monkeypatch.setattr(converter, "PROGRESS_MIN_BYTES", 0)
    converter.load_hf(OURO, progress=True)
    assert "reading tensors" in capsys.readouterr().err


def test_paths_as_pathlib_and_with_tilde(tmp_path, monkeypatch):
    """A pathlib.Path input that does not exist is the one-line error (it was a TypeError out
    of the Hub-name check), and '~' is the home folder, as for the shell (the output was
    written under a folder literally named '~' in the working folder)."""
    from pathlib import Path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(converter.ConvertError, match="does not exist"):
        converter.convert(Path(tmp_path / "nope"), str(tmp_path / "out"), progress=False)
    shutil.copytree(OURO, tmp_path / "home" / "hf", ignore=shutil.ignore_patterns("*.npz"))
    out = converter.convert("~/hf", Path("~/out"), progress=False)
    assert out == str(tmp_path / "home" / "out") and checkpoint.is_checkpoint(out)
    assert os.listdir(work) == []
    assert loopjax.load("~/out").path == out


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGTERM as a command started from a terminal has them (a run started in the
    background by a non-interactive shell inherits SIGINT ignored), put back after."""
    import signal

    previous = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, signal.default_int_handler),
                                                    (signal.SIGTERM, signal.SIG_DFL),
                                                    (signal.SIGHUP, signal.SIG_DFL))}
    yield
    for s, h in previous.items():
        signal.signal(s, h)


@pytest.mark.parametrize("signame, code, word", [("SIGINT", 130, "interrupted"),
                                                 ("SIGTERM", 143, "terminated"), ("SIGHUP", 129, "hung up")])
def test_signal_while_orbax_writes_in_background_leaves_nothing(tmp_path, monkeypatch, capsys,
                                                                terminal_signals, signame, code, word):
    """Orbax writes in background threads that an exception in the main thread does not stop: the
    temporary folder was removed while they wrote on, so they left it behind (re-created) and
    printed tracebacks at exit. Ctrl-C (and the CLI's SIGTERM) now waits for the save to end;
    SIGTERM (and SIGHUP: the terminal closed) killed the process and left the temporary folder."""
    import signal
    import threading
    import time

    writers = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def background_save(path, cfg, params):
        def write():
            for i in range(5):
                time.sleep(0.05)
                os.makedirs(os.path.join(path, "params"), exist_ok=True)
                with open(os.path.join(path, "params", f"chunk{i}"), "w") as f:
                    f.write("data")

        writers.append(threading.Thread(target=write))
        writers[-1].start()
        os.kill(os.getpid(), getattr(signal, signame))  # the signal while the thread writes
        writers[-1].join()

    monkeypatch.setattr(checkpoint, "save", background_save)
    assert convert_cli(OURO, str(tmp_path / "out")) == code
    writers[0].join()
    err = capsys.readouterr().err
    assert err == f"loopjax convert: {word}; nothing was written\n"
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert {s: signal.getsignal(s) for s in previous} == previous


def test_sigterm_before_the_save_leaves_nothing(tmp_path, monkeypatch, capsys, terminal_signals):
    import signal

    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(converter, "_check_aux_files", terminated)  # after the read, before any write
    assert convert_cli(OURO, str(tmp_path / "new" / "out")) == 143
    assert capsys.readouterr().err == "loopjax convert: terminated; nothing was written\n"
    assert os.listdir(tmp_path) == []  # the created parent is gone


def test_output_name_of_255_characters(tmp_path, monkeypatch):
    """The temporary folder's name held the whole output name plus '.' and '.tmp-XXXXXXXX':
    names of 242-255 characters failed with 'File name too long'."""
    def save(path, cfg, params):
        with open(os.path.join(path, "params"), "w") as f:
            f.write("data")

    monkeypatch.setattr(checkpoint, "save", save)
    out = tmp_path / ("o" * 255)
    assert convert_cli(OURO, str(out)) == 0
    assert os.listdir(tmp_path) == [out.name] and os.path.isfile(out / "params")


def test_temporary_folder_of_a_killed_conversion_is_removed_by_the_next(tmp_path, monkeypatch, capsys):
    """A conversion killed outright (SIGKILL, a crash) left its hidden temporary folder
    (gigabytes) for good; the next conversion to that output removes it, one stderr line, and
    only it: another process's that runs, another host's, another output's, a foreign one stay."""
    import socket

    owners = []

    def save(path, cfg, params):
        with open(os.path.join(path, converter.OWNER_FILE), encoding="utf-8") as f:
            owners.append(json.load(f))
        with open(os.path.join(path, "params"), "w") as f:
            f.write("data")

    monkeypatch.setattr(checkpoint, "save", save)
    gone = subprocess.Popen(["true"])
    gone.wait()

    def left_behind(name, **fields):
        (tmp_path / name).mkdir()
        owner = {"host": socket.gethostname(), "pid": gone.pid, "out": "out", **fields}
        (tmp_path / name / converter.OWNER_FILE).write_text(json.dumps(owner))

    left_behind(".out.tmp-killed")
    left_behind(".out.tmp-running", pid=os.getppid())
    left_behind(".out.tmp-elsewhere", host=socket.gethostname() + "-other")
    left_behind(".out.tmp-longer", out="out-v2")  # another output's: names cut at 64 characters meet
    (tmp_path / ".out.tmp-foreign").mkdir()
    out = tmp_path / "out"
    assert convert_cli(OURO, str(out)) == 0
    assert capsys.readouterr().err == (f"loopjax convert: removed {tmp_path / '.out.tmp-killed'}, left by "
                                       f"a conversion (process {gone.pid}) that was killed\n")
    assert sorted(os.listdir(tmp_path)) == [".out.tmp-elsewhere", ".out.tmp-foreign", ".out.tmp-longer",
                                            ".out.tmp-running", "out"]
    assert owners == [{"host": socket.gethostname(), "pid": os.getpid(), "out": "out"}]
    assert converter.OWNER_FILE not in os.listdir(out) and os.path.isfile(out / "params")


def test_disk_full_while_orbax_writes_is_one_line(tmp_path):
    """A full disk: Orbax logged each failed background write with its traceback (200 lines on
    stderr), then raised a ValueError naming a file in the hidden temporary folder."""
    out = tmp_path / "out"
    code = f"""
import sys
from absl import logging as absl_logging
from loopjax import checkpoint
from loopjax.convert import cli

def full_disk(path, cfg, params):
    message = ('RESOURCE_EXHAUSTED: Error writing "embed/0.0" in OCDBT database at local file "' + path
               + '/params/d/1f": Failed to write: No space left on device [os_error_code=\\'28\\']')
    absl_logging.error("[thread=np_type_handler] raised an exception: " + message)
    raise ValueError(message)

checkpoint.save = full_disk
sys.exit(cli.main([{OURO!r}, {str(out)!r}, "--no-progress"]))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"loopjax convert: error: cannot write {out}: No space left on device\n"
    assert os.listdir(tmp_path) == []


def test_loopjax_config_with_layers_beyond_the_params_is_one_line_at_once(tmp_path, converted):
    """num_layers edited to a typo: the specs of every layer were built and compared before the
    error (10**6 layers: 99 s; 10**9: out of memory)."""
    folder = tmp_path / "c"
    shutil.copytree(converted["ouro"], folder)
    file = folder / checkpoint.CONFIG_FILE
    file.write_text(json.dumps({**json.loads(file.read_text()), "num_layers": 100000}))
    message = f"^{file} declares 100000 layers, but the params hold 21 arrays in all$"
    with pytest.raises(checkpoint.CheckpointError, match=message):
        loopjax.load(str(folder))


@pytest.mark.parametrize("field,value", [("rope_theta", [10000.0]), ("rms_norm_eps", "1e-6"),
                                         ("tie_word_embeddings", []), ("eos_token_id", "2")])
def test_loopjax_config_field_of_the_wrong_type_is_one_line(tmp_path, converted, field, value):
    """A hand-edited loopjax_config.json: the checkpoint loaded, then every forward failed on an
    unhashable config or deep in the model (from_dict checked only the integer fields). The line
    names the file (it named none, and an eos_token_id 'config.json', the HF file beside it)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(converted["ouro"], folder)
    data = json.loads((folder / checkpoint.CONFIG_FILE).read_text())
    (folder / checkpoint.CONFIG_FILE).write_text(json.dumps({**data, field: value}))
    with pytest.raises(checkpoint.CheckpointError, match=f"^{folder / checkpoint.CONFIG_FILE} is not a valid "
                       f"loopjax config: ouro config: {field} must be (a number|true or false|a token id)"):
        loopjax.load(str(folder))
