"""The private run folder that the caller and its workers share: the job, the result and error
reports (``transport``), which ranks' code ran to its end (``finished``)."""
