"""How requests run: ``schedulers`` holds the one ``Scheduler`` interface (prepare, responses)
and its three kinds (direct execution, the dynamic batcher, the generation engine);
``batching`` is the dynamic batcher (priority queues, deadlines, preferred sizes); ``gate``
admits requests while the server is ready and counts them for the drain.
"""
