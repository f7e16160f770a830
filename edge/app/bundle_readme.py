"""README.txt of a bundle: how to run its artefact with edgefinfer and with the peer's own runner.

A phone developer takes a bundle to ExecuTorch's runner or demo app, not to Python; the text says
what to copy where, which kernels a C++ build must link, and how to write a chat prompt (the peers'
runners take a prompt string and apply no template). Pure text: no imports beyond the target.
"""

from __future__ import annotations

from edgefinfer.bundle.targets import Target

PROMPT = "{prompt}"


def bundle_readme(target: Target, artefact: str, tokenizer) -> str:
    chat = _chat_example(tokenizer)
    head = (f"edgefinfer bundle for target {target.name}: {target.description}.\n"
            f"Files: {artefact} (the model), tokenizer.json + tokenizer_config.json, manifest.json (sizes,\n"
            "sha256, recipe, measured perplexity and speed).\n\n"
            "Run with edgefinfer:\n"
            f"  edgefinfer run . -p \"The capital of France is\"\n"
            f"  edgefinfer run . --chat -p \"What is the capital of France?\"\n\n")
    body = {"pte": _executorch, "onnx": _onnxruntime, "gguf": _llamacpp, "qnn-context": _qnn}.get(target.format)
    text = head + (body(target, artefact) if body else "")
    if chat:
        text += ("\nChat prompts: the peers' runners take a plain string. This model's chat template renders\n"
                 f"one user turn as (replace {PROMPT}):\n\n{chat}\n")
    return text


def _executorch(target: Target, artefact: str) -> str:
    if target.delegate != "xnnpack":
        return (f"Run with ExecuTorch ({target.delegate} delegate): on a device whose ExecuTorch runtime has that\n"
                "back-end registered, with ExecuTorch's TextLLMRunner as below; it cannot run on this build host.\n")
    return (
        "Run with ExecuTorch's own LLM runner (the one behind its Android and iOS demo apps):\n"
        "  Python (executorch==1.5.1 wheel):\n"
        "    import executorch.kernels.quantized, executorch.extension.llm.custom_ops.custom_ops  # kernels\n"
        "    from executorch.extension.llm.runner import TextLLMRunner, GenerationConfig\n"
        f"    runner = TextLLMRunner(\"{artefact}\", \"tokenizer.json\")\n"
        "    runner.generate(\"The capital of France is\",\n"
        "                    GenerationConfig(max_new_tokens=64, temperature=0.0, echo=False))\n"
        "  C++: build ExecuTorch with XNNPACK and the LLM runner (-DEXECUTORCH_BUILD_XNNPACK=ON\n"
        "    -DEXECUTORCH_BUILD_KERNELS_QUANTIZED=ON -DEXECUTORCH_BUILD_KERNELS_LLM=ON\n"
        "    -DEXECUTORCH_BUILD_EXTENSION_LLM_RUNNER=ON); the program uses ExecuTorch's custom ops\n"
        "    llama::update_cache / llama::custom_sdpa and quantized_decomposed::embedding_4bit, so link\n"
        "    those kernel libraries. Then, e.g. with the llama example runner:\n"
        f"    llama_main --model_path={artefact} --tokenizer_path=tokenizer.json --prompt=\"...\" --temperature=0\n"
        "  Android demo app (LlamaDemo): adb shell mkdir -p /data/local/tmp/llama\n"
        f"    adb push {artefact} tokenizer.json /data/local/tmp/llama/   then pick both in the app's settings.\n"
        "  iOS demo app (etLLM): add model.pte and tokenizer.json to the app's files and select them.\n"
        "tokenizer.json is written in the forms ExecuTorch's C++ tokenizer implements; the build checked\n"
        "that it gives the same token ids as Hugging Face tokenizers (the test suite checks the greedy\n"
        "tokens of TextLLMRunner against edgefinfer run).\n")


def _onnxruntime(target: Target, artefact: str) -> str:
    return (
        "Run with ONNX Runtime's own generator (onnxruntime-genai 0.18), which reads genai_config.json:\n"
        "    import onnxruntime_genai as og\n"
        "    model = og.Model(\".\"); tok = og.Tokenizer(model)\n"
        "    params = og.GeneratorParams(model); params.set_search_options(max_length=128, do_sample=False)\n"
        "    gen = og.Generator(model, params); gen.append_tokens(tok.encode(\"The capital of France is\"))\n"
        "    while not gen.is_done(): gen.generate_next_token()\n"
        "    print(tok.decode(gen.get_sequence(0)))\n"
        f"  (a bundle built with --kv window:N has no genai_config.json: onnxruntime-genai cannot drive its\n"
        f"  windowed cache; run {artefact} with edgefinfer.)\n")


def _llamacpp(target: Target, artefact: str) -> str:
    return (
        "Run with llama.cpp's own tools (the GGUF carries the tokenizer and chat template):\n"
        f"    llama-cli -m {artefact} -p \"The capital of France is\" -n 64 --temp 0\n"
        f"    llama-server -m {artefact} --parallel 4 --port 8000     # OpenAI-compatible\n"
        f"  or edgefinfer serve . --port 8000\n")


def _qnn(target: Target, artefact: str) -> str:
    return (
        "Run with ONNX Runtime's QNN execution provider (onnxruntime-qnn) on a Snapdragon device:\n"
        "    edgefinfer run . -p \"...\"   (HTP on the device, the HTP emulator on x86, or the CPU EP)\n"
        "A runner of your own (Genie-style: prompt_ctx.onnx for prompt chunks, model_ctx.onnx per token):\n"
        "if the manifest names a sink_kv file, load it (numpy .npy, [layers, key/value, kv heads, head dim])\n"
        "into cache slot 0 of every sequence, keep that slot always visible, and start the prompt at\n"
        "position 1 in the other slots: the graphs were calibrated behind that attention sink.\n")


def _chat_example(tokenizer) -> str | None:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    except Exception:  # a template that needs more than one user turn: no example rather than a wrong one
        return None
