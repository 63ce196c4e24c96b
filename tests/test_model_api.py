"""`loopjax.load` (HF folder, converted folder, preset) and `loopjax.forward` dispatch:
golden logits through the public API, tokenizer / generation files, and one clear error for
each bad path or argument."""

import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, models, pre_tokenizers

import loopjax
from loopjax import checkpoint
from loopjax.config import PRESETS
from loopjax.model import LoadError

DATA = os.path.join(os.path.dirname(__file__), "data")
OURO = os.path.join(DATA, "ouro")
HUGINN = os.path.join(DATA, "huginn", "huginn_shape_242")
RTOL = 1e-4
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def presets():
    """The tiny presets, loaded once (random init compiles per leaf shape: slow on CI)."""
    return {name: loopjax.load(name) for name in ("ouro-tiny", "huginn-tiny")}


@pytest.fixture(scope="module")
def ouro_ref():
    return np.load(os.path.join(OURO, "reference_fp32.npz"))


@pytest.fixture(scope="module")
def huginn_ref():
    return (load_file(os.path.join(HUGINN, "inputs.safetensors")),
            load_file(os.path.join(HUGINN, "forward.safetensors")))


@pytest.fixture(scope="module")
def ouro_with_tokenizer(tmp_path_factory):
    """The golden Ouro folder plus a word-level tokenizer and a chat template."""
    folder = tmp_path_factory.mktemp("ouro_tok") / "hf"
    shutil.copytree(OURO, folder, ignore=shutil.ignore_patterns("*.npz"))
    vocab = {"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hello": 3, "loop": 4, "world": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f)
    return str(folder)


def test_load_hf_folder_matches_golden(ouro_ref):
    model = loopjax.load(OURO)
    assert model.family == "ouro" and model.path == OURO
    assert model.dtype == np.float32  # the checkpoint's own dtype
    assert model.generation_config["eos_token_id"] == 2
    assert model.tokenizer is None and model.chat_template is None
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(model.params))
    out = loopjax.forward(model, ouro_ref["p1_input_ids"])
    assert relative_error(out.logits, ouro_ref["p1_logits"]) < RTOL
    # exit_threshold reaches Ouro's threshold rule
    out = loopjax.forward(model, list(ouro_ref["p1_input_ids"]), exit_threshold=0.5)
    np.testing.assert_array_equal(np.asarray(out.exit_loop), ouro_ref["p1_exit_steps_thr0p5"])
    assert relative_error(out.logits, ouro_ref["p1_exit_logits_thr0p5"]) < RTOL


def test_load_hf_folder_writes_nothing(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(HUGINN, folder)
    before = sorted(os.listdir(folder))
    loopjax.load(str(folder), dtype="bfloat16")
    assert sorted(os.listdir(folder)) == before


def test_load_converted_folder(tmp_path, huginn_ref):
    from loopjax.convert.cli import main

    out = str(tmp_path / "huginn")
    assert main([HUGINN, out, "--dtype", "float32", "--no-progress"]) == 0
    model = loopjax.load(out)
    assert model.family == "huginn" and model.dtype == np.float32 and model.path == out
    inputs, golden = huginn_ref
    out_fp32 = loopjax.forward(model, inputs["prompt_ids"][0], loops=4, initial_state=inputs["init_state"][0])
    assert relative_error(out_fp32.logits, golden["logits_steps4"][0]) < RTOL
    zero = loopjax.forward(model, inputs["prompt_ids"][0], loops=4, initial_state="zero")
    assert relative_error(zero.logits, golden["logits_zero_state_steps4"][0]) < RTOL
    bf16 = loopjax.load(out, dtype="bf16")  # restore-time cast
    assert bf16.dtype == np.dtype(jax.numpy.bfloat16)


def test_tokenizer_and_chat_template_survive_conversion(tmp_path, ouro_with_tokenizer):
    out = str(tmp_path / "converted")
    from loopjax.convert import convert

    convert(ouro_with_tokenizer, out, dtype="float32", progress=False)
    for source in (ouro_with_tokenizer, out):
        model = loopjax.load(source)
        ids = model.tokenize("hello loop world")
        assert ids == [3, 4, 5]
        assert model.detokenize(np.array(ids)) == "hello loop world"
        assert model.chat_template == CHAT_TEMPLATE


def test_chat_template_file_not_utf8_is_one_line_naming_it(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(OURO, folder, ignore=shutil.ignore_patterns("*.npz"))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-16")  # a Windows editor's save
    with pytest.raises(LoadError, match=r"chat_template.jinja is not UTF-8 text"):
        loopjax.load(str(folder))


def test_tokenize_without_tokenizer_is_a_clear_error(presets):
    model = presets["ouro-tiny"]
    with pytest.raises(ValueError, match="has no tokenizer"):
        model.tokenize("hi")


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_load_preset(presets, name):
    model = presets[name]
    cfg = PRESETS[name]
    assert model.cfg == cfg and model.path is None and model.dtype == np.float32
    checkpoint.check_against_specs(model.params, checkpoint.model_module(cfg).param_specs(cfg, np.float32),
                                   "preset params")
    out = loopjax.forward(model, [5, 6, 7], loops=2)
    assert out.logits.shape == (3, cfg.vocab_size) and out.logits.dtype == np.float32
    assert np.isfinite(np.asarray(out.logits)).all()


def test_preset_dtype_override():
    assert loopjax.load("ouro-tiny", dtype="bfloat16").dtype == np.dtype(jax.numpy.bfloat16)
    # 'auto' (HF's and vLLM's word): the checkpoint's own dtype, as None
    tiny = loopjax.load("ouro-tiny", dtype="auto")
    assert tiny.dtype == np.float32 and loopjax.load(OURO, dtype="AUTO").dtype == np.float32
    # vLLM's LLM(override_generation_config=...): merged over the model's sampling defaults
    llm = loopjax.LLM(tiny, dtype="AUTO", warmup=False, verbose=False,
                      override_generation_config={"temperature": 0.5})
    assert llm.model is tiny and llm.get_default_sampling_params().temperature == 0.5


def test_bad_paths_name_the_path(tmp_path):
    with pytest.raises(LoadError, match=r"no model at 'nowhere/ouro': not a folder and not a preset "
                                        r"\(presets: .*ouro-tiny"):
        loopjax.load("nowhere/ouro")
    file = tmp_path / "weights.bin"
    file.write_bytes(b"x")
    with pytest.raises(LoadError, match="it is a file, not a model folder"):
        loopjax.load(str(file))
    with pytest.raises(LoadError, match="neither a loopjax checkpoint"):
        loopjax.load(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported dtype 'float16'"):
        loopjax.load("ouro-tiny", dtype="float16")


def test_a_broken_link_is_named_not_read_as_no_file(tmp_path):
    """A Hub snapshot copied without the cache's blobs: its tokenizer.json (a link to
    ../../blobs/HASH) loaded as no tokenizer, its config.json as a folder that is no model."""
    folder = tmp_path / "snapshot"
    shutil.copytree(OURO, folder, ignore=shutil.ignore_patterns("*.npz"))
    os.symlink("../../blobs/5d1e", folder / "tokenizer.json")
    broken = "{}/{} is a broken link: its target ../../blobs/{} is missing$"
    with pytest.raises(ValueError, match=broken.format(folder, "tokenizer.json", "5d1e")):
        loopjax.load(str(folder))
    (folder / "config.json").unlink()
    os.symlink("../../blobs/7b2a", folder / "config.json")
    with pytest.raises(ValueError, match=broken.format(folder, "config.json", "7b2a")):
        loopjax.load(str(folder))


def test_unknown_model_type_lists_supported(tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(OURO, folder, ignore=shutil.ignore_patterns("*.npz"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    supported = "unsupported model_type 'llama'; loopjax supports: huginn_raven, ouro"
    with pytest.raises(ValueError, match=supported):
        loopjax.load(str(folder))


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / checkpoint.CONFIG_FILE).write_text(json.dumps({"model_type": "ouro"}))
    with pytest.raises(checkpoint.CheckpointError, match="not a valid loopjax config"):
        loopjax.load(str(folder))
    cfg = PRESETS["ouro-tiny"]
    (folder / checkpoint.CONFIG_FILE).write_text(json.dumps(loopjax.config.to_dict(cfg)))
    with pytest.raises(checkpoint.CheckpointError, match="has no params/ folder"):
        loopjax.load(str(folder))


def test_checkpoint_of_other_shapes_is_refused(tmp_path, presets):
    model = presets["ouro-tiny"]
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, model.cfg, model.params)
    with pytest.raises(checkpoint.CheckpointError, match="already holds a checkpoint"):
        checkpoint.save(path, model.cfg, model.params)
    bigger = loopjax.config.to_dict(model.cfg) | {"num_layers": 3}
    with open(os.path.join(path, checkpoint.CONFIG_FILE), "w") as f:
        json.dump(bigger, f)
    mismatch = "do not match the model's param_specs: missing layers.2"
    with pytest.raises(checkpoint.CheckpointError, match=mismatch):
        checkpoint.restore(path)


def test_damaged_params_are_a_one_line_error(tmp_path, presets, caplog):
    """A truncated or deleted data file (Orbax raises a bare Exception of many lines) and a
    missing metadata file: one line naming the folder, and the tensor where Orbax says."""
    model = presets["ouro-tiny"]
    path = tmp_path / "ckpt"
    checkpoint.save(str(path), model.cfg, model.params)
    data = max((f for f in (path / checkpoint.PARAMS_DIR).rglob("*") if f.is_file()),
               key=lambda f: f.stat().st_size)
    truncated, deleted, no_metadata = (shutil.copytree(path, tmp_path / name)
                                       for name in ("truncated", "deleted", "no_metadata"))
    with open(truncated / data.relative_to(path), "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    os.remove(deleted / data.relative_to(path))
    os.remove(no_metadata / checkpoint.PARAMS_DIR / "_METADATA")
    for folder in (truncated, deleted):
        with pytest.raises(checkpoint.CheckpointError, match=rf"^cannot restore the params of {folder}: .*"
                                                             r"Error reading \"\w+") as info:
            loopjax.load(str(folder))
        assert "\n" not in str(info.value)
    with pytest.raises(checkpoint.CheckpointError, match="its metadata is missing or unreadable$"):
        loopjax.load(str(no_metadata))
    # NOTE: Orbax's absl warning (missing metadata) and asyncio's records of its failed reads (a
    # truncated file, some runs: hundreds of lines) came before the one line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_asyncio_records_of_orbax_tasks_are_dropped_while_restoring(caplog):
    """The filter behind the check above, deterministically: during a restore, asyncio's records
    that name Orbax's tasks are dropped; other records pass, and the filter goes after."""
    log = logging.getLogger("asyncio")
    orbax_task = "unhandled exception during asyncio.run() shutdown\ntask: <Task coro=<orbax/checkpoint/x>>"
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with checkpoint._orbax_task_errors_dropped():
            log.error(orbax_task)
            log.error("another task failed")
        log.error(orbax_task)
    assert [r.getMessage() for r in caplog.records] == ["another task failed", orbax_task]


def test_forward_argument_errors(presets):
    ouro, huginn = presets["ouro-tiny"], presets["huginn-tiny"]
    with pytest.raises(ValueError, match="initial_state is a Huginn argument"):
        loopjax.forward(ouro, [1, 2], initial_state=np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="exit_threshold is an Ouro argument"):
        loopjax.forward(huginn, [1, 2], exit_threshold=0.5)
    with pytest.raises(ValueError, match=r"non-empty 1-D sequence of token ids, got shape \(1, 2\)"):
        loopjax.forward(ouro, [[1, 2]])
    with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary 0..255"):
        loopjax.forward(huginn, [1, 256])
    for model in (ouro, huginn):  # numpy reads [1, True] as [1, 1]
        with pytest.raises(ValueError, match=r"^input_ids must be integer token ids, not booleans$"):
            loopjax.forward(model, [1, True])
    with pytest.raises(ValueError, match="loops must be a non-negative integer"):
        loopjax.forward(huginn, [1, 2], loops=-1)
    for model in (ouro, huginn):  # past the context: refused by both families (Ouro ran on)
        limit = model.cfg.max_context_len
        with pytest.raises(ValueError, match=rf"forward: 530 tokens exceed the context of {limit}"):
            loopjax.forward(model, list(range(10)) * 53)
    # Ouro's threshold is a cumulative probability, checked as SamplingParams checks it
    for bad in (1.5, -0.2, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match=r"exit_threshold must be (a number )?in \[0, 1\]"):
            loopjax.forward(ouro, [1, 2], exit_threshold=bad)
    assert loopjax.forward(ouro, [1, 2], exit_threshold=np.float32(1)).logits.shape == (2, 256)
    # the reference's exit_at_step / use_weighted_exit: one rule, Ouro's only
    for kwargs, message in (({"exit_step": 1, "exit_threshold": 0.5}, "exit_step and exit_threshold exclude"),
                            ({"exit_step": 1, "exit_weighted": True}, "exit_step and exit_weighted exclude"),
                            ({"exit_step": 4}, r"exit_step 4 is outside 0\.\.3"),
                            ({"exit_step": -1}, r"exit_step must be >= 0"),
                            ({"exit_weighted": "yes"}, "exit_weighted must be true or false")):
        with pytest.raises(ValueError, match=message):
            loopjax.forward(ouro, [1, 2], **kwargs)
    for name, value in (("exit_step", 0), ("exit_weighted", True)):
        with pytest.raises(ValueError, match=f"^{name} is an Ouro argument: Huginn has no exit gate"):
            loopjax.forward(huginn, [1, 2], **{name: value})


def test_text_prompts_get_the_tokenizers_special_tokens(tmp_path):
    """Text is encoded as HF's tokenizer(text) and vLLM encode it: with the tokenizer's own
    special tokens (here a BOS its post-processor adds); it was always without them."""
    from tokenizers import processors

    folder = tmp_path / "hf"
    shutil.copytree(OURO, folder, ignore=shutil.ignore_patterns("*.npz"))
    vocab = {"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hello": 3, "loop": 4, "world": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                             special_tokens=[("<|im_start|>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    model = loopjax.load(str(folder))
    assert model.tokenize("hello loop world") == [1, 3, 4, 5]
    assert model.tokenize("hello loop world", add_special_tokens=False) == [3, 4, 5]
    out = loopjax.generate(model, ["hello loop"], max_new_tokens=1)
    assert out[0].prompt_token_ids == [1, 3, 4]


def test_tokenizer_config_add_bos_token_applies_over_tokenizer_json(tmp_path):
    """tokenizer_config.json's add_bos_token / add_eos_token rewrite tokenizer.json's
    post-processor, as transformers' fast tokenizers do (a flag not given is off); they were
    ignored: a config turning a Llama-style BOS off (or on) encoded differently from HF."""
    from tokenizers import processors

    from loopjax.model import _read_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = tmp_path / "tokenizer_config.json"
    for settings, want in (({}, [1, 3, 4]), ({"add_bos_token": False}, [3, 4]),
                           ({"add_eos_token": True}, [3, 4, 2]),
                           ({"add_bos_token": True, "add_eos_token": True}, [1, 3, 4, 2]),
                           ({"add_bos_token": True, "bos_token": None}, [3, 4])):  # no BOS named: none
        config.write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}} | settings))
        assert _read_tokenizer(str(tmp_path)).encode("hello world").ids == want, settings
    assert _read_tokenizer(str(tmp_path)).encode("hello world", add_special_tokens=False).ids == [3, 4]


def test_llama_style_tokenizer_classes_keep_their_bos_default(tmp_path):
    """A Llama-style tokenizer_class (LlamaTokenizerFast, Gemma's, ...) defaults add_bos_token to
    True and always rebuilds the post-processor (transformers v4 and v5): `add_eos_token` alone
    adds both, where it turned the BOS off (the rule of other classes, v5's, kept for them)."""
    from loopjax.model import _read_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))  # no post-processor: the class adds the BOS
    config = tmp_path / "tokenizer_config.json"
    for tokenizer_class, settings, want in (
            ("LlamaTokenizerFast", {"add_eos_token": True}, [1, 3, 4, 2]),
            ("GemmaTokenizer", {}, [1, 3, 4]),
            ("LlamaTokenizer", {"add_bos_token": False}, [3, 4]),
            ("PreTrainedTokenizerFast", {"add_eos_token": True}, [3, 4, 2]),
            ("PreTrainedTokenizerFast", {}, [3, 4])):
        config.write_text(json.dumps({"tokenizer_class": tokenizer_class, "bos_token": "<s>",
                                      "eos_token": "</s>"} | settings))
        assert _read_tokenizer(str(tmp_path)).encode("hello world").ids == want, (tokenizer_class, settings)


def test_generate_cli_chat_renders_the_template_without_special_tokens(tmp_path, monkeypatch, capsys):
    """`loopjax generate --chat`: the prompt is one user message rendered by the checkpoint's
    template and encoded without the tokenizer's BOS (the template writes its own), as the
    server's chat; --chat with --prompt-ids, or a model without a template, is one line."""
    from tokenizers import processors

    import loopjax.llm
    from loopjax import cli

    folder = tmp_path / "hf"
    shutil.copytree(OURO, folder, ignore=shutil.ignore_patterns("*.npz"))
    vocab = {"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hello": 3, "loop": 4, "user": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                             special_tokens=[("<|im_start|>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
    (folder / "chat_template.jinja").write_text(template)
    seen = []

    def fake_generate(model, prompts, **kwargs):
        seen.append(prompts)
        return [loopjax.llm.GenerateOutput(prompts[0], [4], "loop", [4], "length")]

    monkeypatch.setattr(loopjax.llm, "generate", fake_generate)
    assert cli.main(["generate", str(folder), "--prompt", "hello loop", "--chat"]) == 0
    assert seen == [[[1, 5, 3, 4, 2]]] and capsys.readouterr().out == "loop\n"
    assert cli.main(["generate", str(folder), "--prompt", "hello loop"]) == 0  # text as it is
    assert seen[-1] == ["hello loop"]
    assert cli.main(["generate", str(folder), "--prompt-ids", "3,4", "--chat"]) == 2
    assert capsys.readouterr().err == ("loopjax generate: error: --chat takes a --prompt text (the user's "
                                       "message), not --prompt-ids\n")
    (folder / "chat_template.jinja").unlink()
    assert cli.main(["generate", str(folder), "--prompt", "hello", "--chat"]) == 2
    assert capsys.readouterr().err.startswith("loopjax generate: error: chat needs a tokenizer and a chat "
                                              "template: this model has no chat template")


def test_chat_reads_the_special_tokens_once_per_model(tmp_path, monkeypatch):
    """encode_chat (LLM.chat, generate --chat) reread tokenizer_config.json and
    special_tokens_map.json on every call, where the server read them once: a Model reads them
    once now, for both, and the template still gets them."""
    from loopjax import tokenizer_files
    from loopjax.chat import encode_chat
    from loopjax.config import preset

    vocab = {"<unk>": 0, "<s>": 1, "hi": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    model = loopjax.Model(cfg=preset("ouro-tiny"), params={}, tokenizer=tokenizer, path=str(tmp_path),
                          chat_template="{{ bos_token }}{% for m in messages %} {{ m.content }}{% endfor %}")
    reads = []
    real_read = tokenizer_files._read
    monkeypatch.setattr(tokenizer_files, "_read",
                        lambda folder, name: reads.append(name) or real_read(folder, name))
    for _ in range(3):
        assert encode_chat(model, [{"role": "user", "content": "hi"}]) == [1, 2]
    assert sorted(reads) == ["special_tokens_map.json", "tokenizer_config.json"]


def test_hub_names_load_from_the_local_hugging_face_cache(tmp_path, monkeypatch):
    """'org/name' (vLLM's and transformers' model names) loads and converts from the snapshot
    the Hub cache holds ($HF_HUB_CACHE; refs/main, or its one snapshot); a name not there is
    one line telling how to download it. Nothing is downloaded."""
    from loopjax.convert.cli import main as convert_main

    hub = tmp_path / "hub"
    repo = hub / "models--acme--ouro-tiny"
    shutil.copytree(OURO, repo / "snapshots" / "abc123", ignore=shutil.ignore_patterns("*.npz"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    model = loopjax.load("acme/ouro-tiny")
    assert model.path == str(repo / "snapshots" / "abc123") and model.cfg == loopjax.load(OURO).cfg
    assert convert_main(["acme/ouro-tiny", str(tmp_path / "out"), "--no-progress"]) == 0
    assert loopjax.load(str(tmp_path / "out")).cfg == model.cfg
    (repo / "refs" / "main").unlink()  # no refs: the one snapshot serves
    assert loopjax.load("acme/ouro-tiny").path == model.path
    (repo / "snapshots" / "def456").mkdir()  # two and no refs: which one is unknown
    with pytest.raises(LoadError, match=r"^no model at 'acme/ouro-tiny': not a folder and not a preset "
                                        r"\(presets: .*\), and the Hugging Face cache at .*hub holds 2 "
                                        r"snapshots of it but it has no refs/main \(pass the snapshot "
                                        r"folder itself\)$"):
        loopjax.load("acme/ouro-tiny")
    with pytest.raises(LoadError, match=r", nor in the Hugging Face cache at .*hub \(download "
                                        r"it first: huggingface-cli download acme/other\)$"):
        loopjax.load("acme/other")
    with pytest.raises(LoadError, match="not a preset \\(presets: [^)]*\\)$"):  # not a Hub name
        loopjax.load("no-such-model")


def test_hub_cache_refs_main_empty_or_dangling_falls_back_to_the_one_snapshot(tmp_path, monkeypatch):
    """A refs/main that is empty or names a snapshot not in the cache (an interrupted download, a
    pruned cache) read as 'not in the cache' although one snapshot was there; with several, the
    line says which refs/main names none of them."""
    from loopjax import hub_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    for ref in ("", "\n", "gone999\n"):
        (repo / "refs" / "main").write_text(ref)
        assert hub_cache.snapshot("acme/tiny") == str(repo / "snapshots" / "abc123"), ref
    (repo / "snapshots" / "def456").mkdir()
    assert hub_cache.snapshot("acme/tiny") is None
    assert hub_cache.missing_hint("acme/tiny") == (
        f", and the Hugging Face cache at {tmp_path} holds 2 snapshots of it but its refs/main names "
        "'gone999', not one of them (pass the snapshot folder itself)")
    (repo / "refs" / "main").write_text("def456")
    assert hub_cache.snapshot("acme/tiny") == str(repo / "snapshots" / "def456")


def test_hub_cache_folder_is_the_one_huggingface_hub_uses(tmp_path, monkeypatch):
    """huggingface_hub puts the cache under $XDG_CACHE_HOME when HF_HOME is unset, reads the
    legacy $HUGGINGFACE_HUB_CACHE and expands '~' in them: loopjax looked in
    ~/.cache/huggingface/hub (or a folder literally named '~') and said the model was not there."""
    from loopjax import hub_cache

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    repo = tmp_path / "xdg" / "huggingface" / "hub" / "models--acme--ouro-tiny"
    shutil.copytree(OURO, repo / "snapshots" / "abc123", ignore=shutil.ignore_patterns("*.npz"))
    assert loopjax.load("acme/ouro-tiny").path == str(repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hub_cache.cache_dir() == str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", "~/legacy")
    assert hub_cache.cache_dir() == str(tmp_path / "legacy")
    monkeypatch.setenv("HF_HUB_CACHE", "~/new")
    assert hub_cache.cache_dir() == str(tmp_path / "new")


def test_json_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    """HF writes its JSON files in UTF-8 and transformers reads them so; they were read in the
    locale's encoding: under an ASCII (or Latin-1) locale a chat template with a non-ASCII
    character failed conversion as 'not valid JSON' (or loaded garbled)."""
    import subprocess
    import sys

    hf = tmp_path / "hf"
    shutil.copytree(OURO, hf, ignore=shutil.ignore_patterns("*.npz"))
    template = "{{ messages[0]['content'] }} \u2014 caf\u00e9"
    with open(hf / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"chat_template": template}, f, ensure_ascii=False)
    code = f"""
import loopjax
from loopjax.convert import convert
out = convert({str(hf)!r}, {str(tmp_path / 'out')!r}, progress=False)
print(ascii([loopjax.load({str(hf)!r}).chat_template, loopjax.load(out).chat_template]))
"""
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == ascii([template, template])


def test_an_unreadable_tokenizer_json_is_one_line_with_the_tokenizers_reason(tmp_path):
    """The reason came quoted ("cannot read .../tokenizer.json: 'expected value at line 1
    column 1'"): the f-string's `!r` applied to the whole conditional, not only its else."""
    from loopjax.model import LoadError, _read_tokenizer

    (tmp_path / "tokenizer.json").write_text("garbage")
    with pytest.raises(LoadError) as raised:
        _read_tokenizer(str(tmp_path))
    file = tmp_path / "tokenizer.json"
    assert str(raised.value) == f"cannot read {file}: expected value at line 1 column 1"


def test_a_checkpoints_broken_chat_template_is_named_not_the_messages():
    """A checkpoint template jinja2 cannot compile read "messages: the chat template refused them:
    unexpected '}'" (blaming the messages, on every chat request); now the template is named,
    as a request's own template is."""
    from loopjax.chat import render_chat

    with pytest.raises(ValueError, match=r"^chat_template is not a jinja2 template: TemplateSyntaxError: "
                                         r"unexpected '}'$"):
        render_chat("{% for m in messages %}{{ m.content }", [{"role": "user", "content": "hi"}])


def test_dir_lists_the_lazy_public_names():
    """`dir(loopjax)` (and so tab completion) listed submodules but not load, generate, LLM, ...:
    they are imported on first use (module __getattr__) and the module had no __dir__."""
    import loopjax

    assert set(loopjax.__all__) <= set(dir(loopjax))
