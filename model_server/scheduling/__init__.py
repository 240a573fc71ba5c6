"""How requests run: ``schedulers`` holds the one ``Scheduler`` interface (prepare, responses)
and its three kinds (direct execution, the dynamic batcher, the generation engine);
``batching`` is the dynamic batcher (priority queues, deadlines, preferred sizes); ``workers``
are a version's threads that run the model off the loop; ``gate`` admits requests while the
server is ready and counts them for the drain.
"""
