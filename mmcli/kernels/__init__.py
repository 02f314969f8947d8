"""How the work is computed: our C kernels and their build, torch's kernels we choose among, the
fused decode step, the delta rule's backends, NKI, host memory; and the plan that chooses them
once at load."""
