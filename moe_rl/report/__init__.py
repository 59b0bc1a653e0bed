"""The router stability report: ``moe-rl report RUN_DIR [RUN_DIR_B]`` (see render.write_report)."""
