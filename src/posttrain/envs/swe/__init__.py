"""SWE-style repository tasks: the SWE-bench row schema (`tasks`), scoring a patch in a sandboxed checkout
(`scoring`), the bundled tasks (`bundled`) and the training environment with bash / view / str_replace tools
(`environment`). See docs/agents.md."""
