"""qtensor's main job. For now: every format on one tensor (bytes per element and error)."""

from .formats_table import main

if __name__ == "__main__":
    main()
