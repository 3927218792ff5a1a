"""Process B, the runtime: its entry (process, preflight, bootstrap) and the engine loop over rooms that
import only those below them: requests | search | verify > kv > model > kernels | wire > startup_cache."""
