"""The `loopjax` entry point: subcommands import only their own module, and a missing
optional extra is one clear line with exit code 2, not a traceback."""

import importlib
import re

import pytest

import loopjax
from loopjax import cli


def test_missing_extra_is_one_line(monkeypatch, capsys):
    real_import = importlib.import_module

    def fake_import(name, *args):
        if name == "loopjax.serve_cli":
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real_import(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    assert cli.main(["serve", "ouro-tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["loopjax serve: error: missing module 'fastapi'; "
                   "install it with: pip install 'loopjax[serve]'"]


def test_convert_error_goes_through_the_entry_point(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loopjax convert: error:")
    assert not (tmp_path / "out").exists()


def test_loopjax_generate_stays_the_function_after_the_cli_imports_its_module():
    # The function's module is loopjax.llm: importing it (as `loopjax generate` does) must not
    # replace the package attribute `loopjax.generate` with a module.
    import loopjax
    import loopjax.generate_cli  # noqa: F401
    import loopjax.llm  # noqa: F401

    assert callable(loopjax.generate) and callable(loopjax.LLM)


def test_ctrl_c_in_generate_is_one_line_exit_130(monkeypatch, capsys):
    """Ctrl-C while the engine compiles or generates (minutes for a real model) was a page of
    JAX traceback; now one line and the shell's 128 + SIGINT."""
    import loopjax.llm

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loopjax.llm, "generate", interrupted)
    assert cli.main(["generate", "ouro-tiny", "--prompt-ids", "1,2"]) == 130
    assert capsys.readouterr().err == "loopjax generate: interrupted\n"


def test_out_of_memory_in_generate_is_one_line(monkeypatch, capsys):
    """A model too large for the device (or host) memory: XLA's RESOURCE_EXHAUSTED (a
    RuntimeError) or a MemoryError was a traceback; now one line, exit code 2."""
    import loopjax.llm

    xla = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7.00GiB.\n"
                       "BufferAssignment OOM Debugging.")
    step = RuntimeError("a step failed on the device (XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory); "
                        "1 running request aborted")  # the Engine's line for a failed read
    for error, detail in ((xla, ": RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7.00GiB."),
                          (MemoryError(), ""), (step, f": {step}")):
        def out_of_memory(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(loopjax.llm, "generate", out_of_memory)
        assert cli.main(["generate", "ouro-tiny", "--prompt-ids", "1,2"]) == 2
        assert capsys.readouterr().err == f"loopjax generate: error: out of memory{detail}\n"


def test_a_device_error_in_generate_is_one_line(monkeypatch, capsys):
    """A step that failed on the device for another reason than memory: the Engine's one line,
    exit code 2 (it was a traceback)."""
    import loopjax.llm
    from loopjax.request import StepFailedError

    line = ("a step failed on the device (XlaRuntimeError: INTERNAL: an illegal memory access); 1 "
            "running request aborted, the KV pool made anew")

    def failed(*args, **kwargs):
        raise StepFailedError(line, ["0"], True)

    monkeypatch.setattr(loopjax.llm, "generate", failed)
    assert cli.main(["generate", "ouro-tiny", "--prompt-ids", "1,2"]) == 2
    assert capsys.readouterr().err == f"loopjax generate: error: {line}\n"


def test_no_help_text_prints_default_none(capsys):
    """Every option whose default is no value says what that means (an engine flag's "default:
    None" told nothing: the model's context, the CPU count...)."""
    import dataclasses

    from loopjax.engine_config import DEFAULT_WORDS, EngineConfig
    texts = {}
    for command in ("generate", "serve", "bench", "convert"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        texts[command] = " ".join(capsys.readouterr().out.split())
        assert "default: None" not in texts[command] and "default: ()" not in texts[command], command
    assert "--max-context-len INT default: the model's context length, at most 4096" in texts["serve"]
    assert "--huginn-seed INT default: 0; Huginn models only" in texts["serve"]  # check_family refuses it
    # README's `loopjax serve MODEL [--host 127.0.0.1] [--port 8000]`: --help named neither default
    for shown in ("--host HOST default: 127.0.0.1", "--port PORT default: 8000;", "(default: info;"):
        assert shown in texts["serve"], shown
    for shown in ("--temperature TEMPERATURE 0 = greedy (default: 0)", "{per_loop,shared} default: per_loop",
                  "pallas_mgpu} default: auto", "select (default)", "EXIT_CHECK_EVERY --exit-criterion"):
        assert shown in texts["generate"], shown
    assert "{burst,sessions} burst: C requests at once; sessions: multi-turn chats (default: burst)" \
        in texts["bench"]
    sizes = (("-P PROMPT_LEN", 512), ("-O OUTPUT_LEN", 128), ("-N SESSIONS", 64), ("-T TURNS", 6),
             ("-U USER_LEN", 64))  # the workload's (bench/workloads.WorkloadSpec)
    for flag, default in sizes:
        assert re.search(f"{flag} [^-]*\\(default: {default}\\)", texts["bench"]), flag
    blank = {f.name for f in dataclasses.fields(EngineConfig) if f.default in (None, ())}
    assert blank == set(DEFAULT_WORDS)  # a new field defaulting to no value needs its words


def test_version(capsys):
    """`loopjax --version` names the installed package's version (what /version answers)."""
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"loopjax {loopjax.__version__}\n"
    assert loopjax.__version__ not in ("", "unknown")


def test_generate_shared_kv_slots_reach_the_engine_refused_as_it_refuses(monkeypatch, capsys):
    """`loopjax generate --shared-kv-slots K` (EngineConfig.shared_kv_slots: Huginn's shared KV
    ring; there was no flag) reaches the engine options; where the engine refuses it (not
    Huginn with --kv-layout shared, or below 1) it is the engine's one line (before it compiles), as
    is `--exit-mode skip` on Huginn without `--exit-criterion` (it ran every loop); the lines name
    the flags given, not the EngineConfig / SamplingParams fields."""
    import loopjax.llm
    import loopjax.model
    from loopjax.config import preset

    # NOTE: the refusals come before any weight is read: a model without weights serves
    weightless = loopjax.model.Model(cfg=preset("huginn-tiny"), params={})
    monkeypatch.setattr(loopjax.model, "load", lambda name, dtype=None: weightless)
    for argv, error in (
            (["huginn-tiny", "--kv-layout", "shared", "--shared-kv-slots", "0"],
             "--shared-kv-slots must be >= 1, got 0"),
            (["huginn-tiny", "--shared-kv-slots", "4"],
             "--shared-kv-slots 4 applies to Huginn's --kv-layout shared ring; this Huginn "
             "model has --kv-layout per_loop")):
        assert cli.main(["generate", *argv, "--prompt-ids", "1,2"]) == 2
        assert capsys.readouterr().err == f"loopjax generate: error: {error}\n"
    # the engine's refusal (sampling_params.check_for_model) comes before any engine is built
    assert cli.main(["generate", "huginn-tiny", "--prompt-ids", "1,2", "--exit-mode", "skip"]) == 2
    assert capsys.readouterr().err == ("loopjax generate: error: --exit-mode skip on a Huginn model stops "
                                       "at its --exit-criterion; give one (or an --exit-trace)\n")
    seen = []

    def fake_generate(model, prompts, **kwargs):
        seen.append(kwargs["engine_options"])
        return [loopjax.llm.GenerateOutput(prompts[0], [3], None, [1], "length")]

    monkeypatch.setattr(loopjax.llm, "generate", fake_generate)
    assert cli.main(["generate", "huginn-tiny", "--prompt-ids", "1,2", "--kv-layout", "shared",
                     "--shared-kv-slots", "4"]) == 0
    assert seen[-1]["shared_kv_slots"] == 4 and seen[-1]["kv_layout"] == "shared"
    assert capsys.readouterr().out == "3\n"


def test_an_unknown_engine_arg_is_named_with_the_closest_field():
    """`--engine-arg KEY=VALUE` with a KEY no EngineConfig field has was refused as
    "EngineConfig.__init__() got an unexpected keyword argument": it names the key now, and the
    field it is closest to."""
    import argparse

    from loopjax.engine_args import add_engine_arguments, engine_config_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_kwargs(parser.parse_args(["--engine-arg", "max-num-rows=4"])) == {"max_num_rows": 4}
    for arg, error in (("max_num_row=4", "'max_num_row'; did you mean 'max_num_rows'?"),
                       ("zzz=1", "'zzz' (the EngineConfig fields: --help)")):
        with pytest.raises(ValueError, match=f"^--engine-arg: unknown engine option {re.escape(error)}$"):
            engine_config_kwargs(parser.parse_args(["--engine-arg", arg]))


def test_parse_errors_are_one_line_naming_the_command(capsys):
    """A bad flag printed argparse's usage block (a screen of flags for serve and bench) above
    the one line naming the cause; an unknown flag named the top-level `loopjax` and its usage.
    Now one line, `loopjax CMD: error: CAUSE (see --help)`, exit code 2, for every command."""
    for argv, cause in (
            (["generate", "ouro-tiny", "--prompt-ids", "1", "--temperature", "x"],
             "loopjax generate: error: argument --temperature: invalid float value: 'x'"),
            (["generate", "ouro-tiny", "--prompt-ids", "1", "--bogus"],
             "loopjax generate: error: unrecognized arguments: --bogus"),
            (["bench", "ouro-tiny", "-C", "x"],
             "loopjax bench: error: argument --concurrency/-C: must be an integer >= 1, got 'x'"),
            (["bench", "ouro-tiny", "-P", "0"],  # WorkloadSpec's check named its field, prompt_len
             "loopjax bench: error: argument --prompt-len/-P: must be an integer >= 1, got '0'"),
            (["serve", "ouro-tiny", "--port", "x"],
             "loopjax serve: error: argument --port: must be an integer in [0, 65535], got 'x'"),
            (["convert"], "loopjax convert: error: the following arguments are required: HF_DIR, OUT_DIR"),
            (["frob"], "loopjax: error: argument command: invalid choice: 'frob' (choose from 'convert', "
                       "'generate', 'serve', 'bench')")):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 2 and capsys.readouterr().err == f"{cause} (see --help)\n", argv


def test_engine_errors_name_the_flags_the_command_line_has(monkeypatch, capsys):
    """An engine refusal named EngineConfig fields (`EngineConfig.num_pages and kv_memory_bytes`)
    to a user who typed flags; the command lines name their flags now (bench and serve every
    field's, generate its own, the sampling flags too), exit code 2; Python callers keep the
    field names."""
    import argparse

    import loopjax.model
    from loopjax.config import preset
    from loopjax.engine_args import add_engine_arguments, add_sampling_arguments, failure_line
    from loopjax.engine_config import EngineConfig

    weightless = loopjax.model.Model(cfg=preset("ouro-tiny"), params={})
    monkeypatch.setattr(loopjax.model, "load", lambda name, dtype=None: weightless)
    assert cli.main(["bench", "ouro-tiny", "--num-pages", "3", "--engine-arg", "kv_memory_bytes=100"]) == 2
    assert capsys.readouterr().err == ("loopjax bench: error: --num-pages and --kv-memory-bytes both size "
                                       "the KV pool; give one\n")
    # an implementation's name: refused at parsing (the flag's choices), or by the engine before
    # it allocates anything (it failed after the KV pool, for matmul and pointwise)
    with pytest.raises(SystemExit):
        cli.main(["bench", "ouro-tiny", "--matmul", "cublas"])
    assert "argument --matmul: invalid choice: 'cublas' (choose from " in capsys.readouterr().err
    assert cli.main(["bench", "ouro-tiny", "--engine-arg", "matmul=cublas"]) == 2
    assert capsys.readouterr().err == ("loopjax bench: error: --matmul must be one of auto, xla, streaming, "
                                       "persistent, got 'cublas'\n")
    with pytest.raises(ValueError, match="^EngineConfig.num_pages and kv_memory_bytes both size"):
        EngineConfig(num_pages=3, kv_memory_bytes=100)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    add_sampling_arguments(parser)
    args = parser.parse_args([])
    for line, named in (("max_context_len 9000 exceeds the model's 4096", "--max-context-len 9000 exceeds"),
                        ("EngineConfig.matmul must be <class 'str'>, got 1", "--matmul must be"),
                        ("unknown matmul 'x'; choose 'auto'", "unknown matmul 'x'"),  # prose: kept
                        ("top_p must be in (0, 1], got 2.0", "--top-p must be in"),
                        ("SchedulerConfig.max_loops (2) < num_loops (4)", "SchedulerConfig.max_loops (2)")):
        assert failure_line(ValueError(line), args).startswith(named), line
        assert failure_line(ValueError(line)) == line  # without the command line: as raised
    # generate has no --max-context-len (it sizes the context itself): that name stays
    generate_args = argparse.Namespace(kv_layout="shared", top_p=1.0, warm_start=True)
    assert failure_line(ValueError("max_context_len 9 and kv_layout"), generate_args) == \
        "max_context_len 9 and --kv-layout"
    assert failure_line(ValueError("warm_start applies to Huginn models only"), generate_args) == \
        "--warm-start applies to Huginn models only"  # generate's keyword, not a SamplingParams field


def test_a_closed_stdout_pipe_ends_quietly(monkeypatch, capsys):
    """`loopjax generate ... | head -1` (a reader that stops early): the broken pipe was a line
    `error: [Errno 32] Broken pipe` and, at exit, Python's `Exception ignored ... BrokenPipeError`.
    Now nothing on stderr and the shell's 128 + SIGPIPE, as Unix tools end."""
    import io
    import os
    import subprocess
    import sys

    import loopjax.llm
    import loopjax.model
    from loopjax.config import preset

    class ClosedPipe(io.TextIOBase):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    weightless = loopjax.model.Model(cfg=preset("ouro-tiny"), params={})
    monkeypatch.setattr(loopjax.model, "load", lambda name, dtype=None: weightless)
    monkeypatch.setattr(loopjax.llm, "generate", lambda model, prompts, **kwargs: [
        loopjax.llm.GenerateOutput(prompts[0], [3], None, [1], "length")])
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["generate", "ouro-tiny", "--prompt-ids", "1,2", "--max-tokens", "1"]) == cli.SIGPIPE_EXIT
    monkeypatch.undo()
    assert capsys.readouterr().err == ""
    # A real pipe whose reader is gone, through the interpreter's exit (where a buffered line is flushed)
    read_end, write_end = os.pipe()
    os.close(read_end)
    code = "import sys; from loopjax import cli; sys.exit(cli.run_command(lambda a: print('4 5') or 0, None))"
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE,
                              timeout=60)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (cli.SIGPIPE_EXIT, b"")


def test_an_option_of_the_other_family_names_the_family_not_the_layout():
    """An option the model's family ignores said "this ouro model has kv_layout='shared'" (the
    layout explains only a per_loop Huginn's unused ring): the family it is now."""
    from loopjax.engine_config import EngineConfig

    for options, family, tail in (
            (dict(kv_layout="shared", shared_kv_slots=2), "ouro", "this is an Ouro model"),
            (dict(huginn_seed=3), "ouro", "this is an Ouro model"),
            (dict(enable_weighted_exit=True), "huginn", "this is a Huginn model"),
            (dict(shared_kv_slots=2), "huginn", "this Huginn model has kv_layout='per_loop'")):
        with pytest.raises(ValueError, match=f"; {tail}$"):
            EngineConfig(**options).check_family(family)


def test_generate_refusals_name_flags_and_values_as_typed(monkeypatch, capsys):
    """`generate --loops 0` said `loops must be >= 1` and `--max-tokens 0` `max_new_tokens must be
    >= 1` (a plain-word field, a keyword of another name: not mapped to their flags); `--exit-criterion
    foo` `must be None or one of`; values came as Python writes them (`--exit-mode='select'`,
    `--exit-in-prefill=False`). Every line names the flag and the value as typed now; the
    implementation choices of generate, serve and bench are one table (engine_config's, JAX-free)."""
    import argparse

    import loopjax.model
    from loopjax.config import preset
    from loopjax.engine_args import failure_line
    from loopjax.engine_config import OPTION_CHOICES

    monkeypatch.setattr(loopjax.model, "load", lambda name, dtype=None: loopjax.model.Model(
        cfg=preset(name), params={}))  # refused before any weight is read
    for flags, error in ((["--loops", "0"], "--loops must be >= 1, got 0"),
                         (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
                         (["--temperature", "3"], "--temperature must be in [0, 2.0], got 3.0"),
                         (["--exit-weighted", "--exit-mode", "skip"],
                          "--exit-weighted needs every loop's logits: use --exit-mode select"),
                         (["--no-exit-in-prefill"], "--no-exit-in-prefill keeps an --exit-criterion (Huginn) "
                                                    "out of the prompt; give one")):
        assert cli.main(["generate", "ouro-tiny", "--prompt-ids", "1,2", *flags]) == 2
        assert capsys.readouterr().err == f"loopjax generate: error: {error}\n", flags
    assert cli.main(["generate", "ouro-tiny", "--prompt-ids", "1,999"]) == 2  # it was `prompt 0: ...`
    assert capsys.readouterr().err.startswith("loopjax generate: error: --prompt-ids: token id 999 is")
    serve = argparse.Namespace(override_generation_config=None, top_p=1.0)  # serve's own flag, too
    assert failure_line(ValueError("override_generation_config's sampling defaults are not usable"),
                        serve).startswith("--override-generation-config's")
    with pytest.raises(SystemExit):
        cli.main(["generate", "huginn-tiny", "--prompt-ids", "1", "--exit-criterion", "foo"])
    assert "argument --exit-criterion: invalid choice: 'foo' (choose from 'kl', " in capsys.readouterr().err
    monkeypatch.setitem(OPTION_CHOICES, "attention_backend", ("auto", "newer"))  # read from the table
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "{auto,newer}" in capsys.readouterr().out
