"""Models over time, as KServe's ModelRepository and Model: ``repository`` (the model
directory: index, load, unload, poll, versions and their policy) and ``version`` (one
version's life: loading, warm-up, READY, its scheduler, unloading after its requests).
"""
