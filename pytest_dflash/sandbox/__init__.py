"""The sandboxed executor for generated code and its seccomp filter."""
