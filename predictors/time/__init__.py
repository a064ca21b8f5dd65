"""The training-time predictor: trace (:mod:`.trace`), roofline (:mod:`.analytical`,
:mod:`.network`), learned correction (:mod:`.model`), fitted efficiencies (:mod:`.efficiency`,
:mod:`.efficiency_fit`) and the entry point :func:`predictors.time.predictor.predict_iteration_time`."""
