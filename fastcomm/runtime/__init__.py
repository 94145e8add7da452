"""The kernel runtime both products use (the collectives, fastcomm.kquant): NVRTC compile of csrc/'s units with
a disk cache built once per machine (``jit``), a kernel's entry points and packed arguments (``kernel``), launches
CuPy does not wrap (clusters, programmatic dependent launch: ``launch_ex``), and the resource table of a built
cubin (``cubin``). It knows neither product's kernels."""
