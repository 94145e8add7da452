# A package, so pytest puts the repository root on sys.path for the tests here rather than tests/ itself:
# with tests/ on the path, the folder tests/vllm/ was importable as a namespace package named `vllm`, and
# without vLLM installed `pytest.importorskip("vllm")` imported the test folder instead of skipping.
