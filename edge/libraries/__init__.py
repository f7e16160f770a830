"""Third-party libraries, guarded (no vendored code): their chatter kept out of our output, and
ONNX Runtime with its Qualcomm QNN execution provider, shared by the exporter and the runtime, and
the thread counts that llama.cpp, ONNX Runtime and ExecuTorch start with by default (`cpus`).

A room of the foundation: README.md, Layout; tests/test_layering.py, ROOMS."""
